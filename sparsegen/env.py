"""Every SPARSEGEN_* environment variable, read in one place."""
import os
from pathlib import Path


def cache_dir() -> Path:
    """On-disk kernel cache: SPARSEGEN_CACHE_DIR, else the user's cache dir."""
    override = os.environ.get("SPARSEGEN_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sparsegen"


def dump_dir() -> Path:
    """Where generated sources of failed compiles are written (SPARSEGEN_DUMP_DIR)."""
    override = os.environ.get("SPARSEGEN_DUMP_DIR")
    return Path(override) if override else cache_dir() / "failed"


def disable_disk_cache() -> bool:
    """SPARSEGEN_NO_DISK_CACHE=1 compiles every kernel fresh (template development)."""
    return os.environ.get("SPARSEGEN_NO_DISK_CACHE", "") not in ("", "0")


def compress_kernel() -> bool:
    """SPARSEGEN_COMPRESS_KERNEL=1 packs 2:4 weights on the GPU with the generated
    sp24_compress kernel instead of PyTorch ops. Off by default until it has run on a GPU
    (it compiles in CI; no GPU time was left to run it in the session that wrote it)."""
    return os.environ.get("SPARSEGEN_COMPRESS_KERNEL", "") not in ("", "0")
