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
    """2:4 pruning and packing of CUDA 16-bit and one-byte weights runs on the generated sp24_compress
    and sp24_mask kernels; SPARSEGEN_COMPRESS_KERNEL=0 falls back to PyTorch ops."""
    return os.environ.get("SPARSEGEN_COMPRESS_KERNEL", "1") not in ("", "0")


def dense_fallback() -> bool:
    """Layers take cuBLAS on a dense copy of their weight where the GPU's crossover table
    says their sparse kernel would lose; SPARSEGEN_DENSE_FALLBACK=0 keeps every call sparse."""
    return os.environ.get("SPARSEGEN_DENSE_FALLBACK", "1") not in ("", "0")
