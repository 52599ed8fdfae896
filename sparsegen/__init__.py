"""sparsegen: JIT-generated sparse kernels for PyTorch layers.

The public names load on first use, all together (PEP 562 `__getattr__`): `import sparsegen`
alone imports neither torch nor the layers, so the `sparsegen` command answers `--help` and
refuses a bad command line without torch's few seconds of import. Anything that makes or runs
a layer - `sparsegen.patch`, `sparsegen.linear`, a pickled model's classes, a first
torch.compile trace (launch/library.py) - loads everything, the compiled graphs' lowerings
included.
"""
import importlib
import importlib.util
import threading

from . import env
from .errors import CompileError, ConfigError, InputError, LaunchError, SparsegenError, SpecError

__version__ = "0.1.0"

# public name -> the module that defines it (relative to this package), or the module itself
_PUBLIC = {
    "UntrustedPathError": ".jit.trust", "BlockSparseLinear": ".bsr.nn", "linear": ".factory",
    "Sparse24Linear": ".semi24.nn", "ScaledSparse24Linear": ".semi24.scaled", "Int4Sparse24Linear": ".semi24.int4_nn",
    "load_compressed": ".compressed",
    "topology": ".bsr.topology", "GatedMLP": ".patching", "patch": ".patching", "dense_copy": ".dense_twin",
    "KernelSpec": ".jit.spec", "TileConfig": ".jit.spec", "Sparse24Tensor": ".semi24.tensor",
    "to_sparse24": ".semi24.tensor", "Sparse24TrainingLinear": ".semi24.train",
    "dense_finetune_": ".semi24.train", "masked_decay_": ".semi24.train",
}
__all__ = ["BlockSparseLinear", "linear", "patch", "dense_copy", "GatedMLP", "topology", "KernelSpec", "TileConfig",
           "SparsegenError", "SpecError", "CompileError", "InputError", "ConfigError", "LaunchError",
           "UntrustedPathError", "Sparse24Linear", "ScaledSparse24Linear", "Int4Sparse24Linear", "load_compressed", "Sparse24Tensor",
           "Sparse24TrainingLinear", "to_sparse24", "masked_decay_", "dense_finetune_", "__version__"]


def _load_nvrtc() -> None:
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()  # (the library itself loads at the first call)
    except Exception:  # (none installed, or broken: the first build says so)
        pass


def _load_nvrtc_soon() -> None:
    """Loading NVRTC costs a new process ~0.1 s, which the first kernel build - during patch,
    with an empty cache - would wait for: a daemon thread loads it from here on, while the user
    builds or loads a model (sparsegen.warm). Nothing waits for it; SPARSEGEN_WARM=0 turns it
    off, and a malformed value is left for patch to report."""
    try:
        if not env.warm_kernels():
            return
    except ConfigError:
        return
    threading.Thread(target=_load_nvrtc, name="sparsegen-nvrtc", daemon=True).start()


_load_nvrtc_soon()


def load() -> None:
    """Import every public name now, and the compiled graphs' lowerings (sparsegen.inductor)."""
    for name, path in _PUBLIC.items():
        module = importlib.import_module(path, __name__)
        globals()[name] = module if path.endswith("." + name) else getattr(module, name)  # (topology: a module)
    importlib.import_module(".inductor", __name__)


def __getattr__(name: str):
    if name in _PUBLIC:
        load()
        return globals()[name]
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # A submodule reached as an attribute: imported, and nothing else (`from .. import
        # checkpoint` inside the package asks for the attribute first, mid-import).
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
