"""sparsegen: JIT-generated sparse kernels for PyTorch layers."""
from .errors import CompileError, ConfigError, InputError, LaunchError, SparsegenError, SpecError
from .jit.trust import UntrustedPathError
from .bsr.nn import BlockSparseLinear
from .factory import linear
from .semi24.nn import Sparse24Linear
from .semi24.scaled import ScaledSparse24Linear
from .compressed import load_compressed
from . import inductor  # noqa: F401 (the compiled graphs' lowerings)
from .bsr import topology
from .patching import GatedMLP, patch
from .dense_twin import dense_copy
from .jit.spec import KernelSpec, TileConfig
from .semi24.tensor import Sparse24Tensor, to_sparse24
from .semi24.train import Sparse24TrainingLinear, dense_finetune_, masked_decay_

__version__ = "0.1.0"
__all__ = ["BlockSparseLinear", "linear", "patch", "dense_copy", "GatedMLP", "topology", "KernelSpec", "TileConfig", "SparsegenError",
           "SpecError", "CompileError", "InputError", "ConfigError", "LaunchError", "UntrustedPathError", "Sparse24Linear", "ScaledSparse24Linear", "load_compressed", "Sparse24Tensor", "Sparse24TrainingLinear", "to_sparse24",
           "masked_decay_", "dense_finetune_", "__version__"]
