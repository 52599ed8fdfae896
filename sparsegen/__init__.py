"""sparsegen: JIT-generated sparse kernels for PyTorch layers."""
from .errors import CompileError, InputError, SparsegenError, SpecError
from .nn import BlockSparseLinear, linear
from . import topology
from .patching import patch
from .spec import KernelSpec, TileConfig

__version__ = "0.1.0"
__all__ = ["BlockSparseLinear", "linear", "patch", "topology", "KernelSpec", "TileConfig", "SparsegenError",
           "SpecError", "CompileError", "InputError", "__version__"]
