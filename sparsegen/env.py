"""Every SPARSEGEN_* environment variable, read in one place. A switch takes 1/0 (also
true/false, yes/no, on/off); anything else is a ConfigError, not a guess."""
import functools
import os
import tempfile
import warnings
from pathlib import Path

from .errors import ConfigError, expect

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _switch(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    expect(value in _TRUE + _FALSE, f"{name} of 1 or 0 (true/false, yes/no, on/off)", repr(raw), ConfigError)
    return value in _TRUE


def _path(name: str) -> Path | None:
    raw = os.environ.get(name, "")
    return Path(raw).expanduser() if raw.strip() else None


def team_cache_dir() -> Path | None:
    """SPARSEGEN_TEAM_CACHE_DIR: an opt-in cache shared by a group (trust.py)."""
    return _path("SPARSEGEN_TEAM_CACHE_DIR")


def cache_dir() -> Path:
    """On-disk kernel cache: the opt-in team cache SPARSEGEN_TEAM_CACHE_DIR (trust.py), else
    SPARSEGEN_CACHE_DIR, else the user's cache dir."""
    override = team_cache_dir() or _path("SPARSEGEN_CACHE_DIR")
    if override:
        return override
    base = os.environ.get("XDG_CACHE_HOME") or _home()
    return Path(base) / "sparsegen" if base else _private_temporary_cache()


def _home() -> Path | None:
    """~/.cache, or None without a home (HOME unset and no passwd entry for this uid)."""
    try:
        return Path.home() / ".cache"
    except (RuntimeError, KeyError):
        return None


@functools.lru_cache(maxsize=1)
def _private_temporary_cache() -> Path:
    """A fresh 0700 directory of this process's own (mkdtemp: a new name, made exclusively),
    said once: kernels then last as long as the system's temporary files."""
    folder = Path(tempfile.mkdtemp(prefix="sparsegen-cache-"))
    warnings.warn(f"sparsegen: no home directory to keep kernels in (HOME is unset and uid {os.geteuid()} has "
                  f"no passwd entry); caching them in {folder} for this process. Set SPARSEGEN_CACHE_DIR to "
                  "keep them.", RuntimeWarning, stacklevel=2)
    return folder


def dump_dir() -> Path:
    """Where generated sources of failed compiles are written (SPARSEGEN_DUMP_DIR)."""
    return _path("SPARSEGEN_DUMP_DIR") or cache_dir() / "failed"


def disable_disk_cache() -> bool:
    """SPARSEGEN_NO_DISK_CACHE=1 compiles every kernel fresh (template development)."""
    return _switch("SPARSEGEN_NO_DISK_CACHE", False)


def compress_kernel() -> bool:
    """2:4 pruning and packing of CUDA 16-bit and one-byte weights runs on the generated sp24_compress
    and sp24_mask kernels (and a one-byte layer's kept values are quantized by sp24_quantize);
    SPARSEGEN_COMPRESS_KERNEL=0 falls back to PyTorch ops."""
    return _switch("SPARSEGEN_COMPRESS_KERNEL", True)


def gated_kernel() -> bool:
    """A gated MLP's act(gate) * up in a training step (and its gradient) runs on the generated
    gated_product kernel, one pass each way; SPARSEGEN_GATED_KERNEL=0 falls back to PyTorch ops."""
    return _switch("SPARSEGEN_GATED_KERNEL", True)


def warm_kernels() -> bool:
    """Whether patch() starts building the patched layers' likely kernels on background
    threads (sparsegen.warm); SPARSEGEN_WARM=0 builds each at first use instead."""
    return _switch("SPARSEGEN_WARM", True)


def dense_fallback() -> bool:
    """SPARSEGEN_DENSE_FALLBACK=1: layers take cuBLAS on a dense copy of their weight where the
    GPU's crossover table says their sparse kernel would lose. Off by default: a sparse layer
    keeps its memory saving (in one bench_generate run on an H200, the sparse layers of three
    4-layer Llama-3-8B-shaped models - 2:4, block 128, FP8 2:4 - held 2112 MB of copies between
    them). BENCHMARKS.md's generate() figures hold none; its tables before d19a82d ran with it on."""
    return _switch("SPARSEGEN_DENSE_FALLBACK", False)


def persistent_waves() -> int:
    """Blocks a persistent kernel launches, in multiples of what the GPU runs at once:
    SPARSEGEN_PERSISTENT_WAVES (a whole number >= 1, default 1). More waves leave fewer tiles
    per block, so a kernel that shares the GPU with others (NCCL's, overlapping a backward)
    waits less for its last blocks."""
    raw = os.environ.get("SPARSEGEN_PERSISTENT_WAVES", "1").strip()
    expect(raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 64, "SPARSEGEN_PERSISTENT_WAVES of a whole number in [1, 64]",
           repr(raw), ConfigError)
    return int(raw)


def kernel_bundles() -> list[Path]:
    """Read-only bundles of precompiled kernels, searched in order before the user cache:
    SPARSEGEN_KERNEL_BUNDLE=DIR[:DIR...] (os.pathsep between them); the installed
    sparsegen_kernels package's come after them (jit.bundle.folders)."""
    named = os.environ.get("SPARSEGEN_KERNEL_BUNDLE", "")
    return [Path(part).expanduser() for part in named.split(os.pathsep) if part.strip()]


SHIPPED_KERNELS_PACKAGE = "sparsegen_kernels"  # what tools/build_kernels.py builds


@functools.lru_cache(maxsize=1)
def _shipped_kernels_folders() -> tuple[str, ...]:
    import importlib.util

    spec = importlib.util.find_spec(SHIPPED_KERNELS_PACKAGE)  # (found, not imported: nothing of it runs)
    return tuple(spec.submodule_search_locations or ()) if spec is not None else ()


def shipped_kernels_folders() -> list[Path]:
    """The installed sparsegen_kernels package's folders (one bundle per arch inside), unless
    SPARSEGEN_SHIPPED_KERNELS=0."""
    return [Path(f) for f in _shipped_kernels_folders()] if _switch("SPARSEGEN_SHIPPED_KERNELS", True) else []
