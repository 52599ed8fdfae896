"""Sparse24Linear: a drop-in nn.Linear whose weight is 2:4 semi-structured."""
from __future__ import annotations

import torch
from torch import nn

from ..launch import calls, lean
from .. import checkpoint
from ..jit import epilogues
from ..errors import expect
from ..layer import SparseLinearForward, dense_linear, finish_part, layer_dtype, weight_part
from . import format as semi24
from . import dispatch, ops
from .autograd import forward_product, sp24_linear
from .tensor import Sparse24Tensor, prune_and_compress
from .train import Sparse24TrainingLinear


class Sparse24Linear(SparseLinearForward, lean.LeanLayer, epilogues.Fusable, checkpoint.CheckedLoad, nn.Module):
    """y = x W^T + b with W [out, in] 2:4 along rows: `values` [out, in/2] (the parameter)
    and `metadata` (a buffer in the layout mma.sp reads). fp16/bf16 run the generated
    mma.sp kernel on the GPU; float32 (or a CPU) runs the PyTorch reference.

    Training keeps the mask fixed and trains the kept values (as BlockSparseLinear does);
    `method` ("magnitude", "transposable") picks the mask from the initial weights.
    `fuse(epilogue)` applies an activation or a gated product in the kernel (epilogues.py).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 method: str = "magnitude"):
        super().__init__()
        semi24.check_shape((out_features, in_features))
        self.in_features, self.out_features = int(in_features), int(out_features)
        dtype = layer_dtype(dtype)
        if dtype is not None:
            semi24.check_dtype(dtype)
        dense = nn.Linear(self.in_features, self.out_features, bias=bias, device=device, dtype=dtype)
        self._adopt(dense.weight.detach(), dense.bias, method, None)

    def _adopt(self, weight: torch.Tensor, bias, method: str, mask) -> None:
        semi24.check_dtype(weight.dtype)
        self._forget_lean_calls()
        values, metadata = prune_and_compress(weight, method, mask)
        self.values = nn.Parameter(values)
        self.register_buffer("metadata", metadata)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, method: str | None = None, mask: torch.Tensor | None = None,
                   **recipe):
        """Prune `linear.weight` to 2:4 by `method` (default "magnitude") or the given `mask`,
        and keep the kept values. With 2by4-pretrain options (mask_interval, dw_sparse,
        soft_threshold) it returns a Sparse24TrainingLinear instead (default method
        "transposable")."""
        if recipe:
            expect(mask is None, "no mask with training options (the mask follows the weights)", "a mask")
            return Sparse24TrainingLinear.from_dense(linear, method=method or "transposable", **recipe)
        method = method or "magnitude"
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        semi24.check_shape(tuple(linear.weight.shape))
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer._adopt(linear.weight.detach(), linear.bias, method, mask)
        return layer

    @classmethod
    def gated_pair(cls, gate: "Sparse24Linear", up: "Sparse24Linear", epilogue: str) -> "Sparse24Linear | None":
        """A gated MLP's gate and up (a loaded checkpoint's) as one layer with the gated
        `epilogue`, rows interleaved, each keeping its stored positions (zeros kept included);
        None where they cannot be one (other shapes or dtypes, an epilogue of their own)."""
        if not (gate.values.shape == up.values.shape and gate.values.dtype == up.values.dtype
                and gate.epilogue == up.epilogue == "none"):
            return None
        fused = epilogues.interleaved_linear(gate.to_dense_weight(), up.to_dense_weight(), gate.bias, up.bias)
        return cls.from_dense(fused, mask=epilogues.interleave_rows(gate.mask, up.mask)).fuse(epilogue)

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        semi24.check_loaded_metadata(state_dict, prefix, (self.out_features, self.in_features))

    def _after_load(self) -> None:
        self._forget_lean_calls()

    @property
    def mask(self) -> torch.Tensor:
        return self.sparse_weight().mask

    def sparse_weight(self) -> Sparse24Tensor:
        return Sparse24Tensor(self.values.detach(), self.metadata, (self.out_features, self.in_features))

    def to_dense_weight(self) -> torch.Tensor:
        return semi24.decompress(self.values.detach(), self.metadata, (self.out_features, self.in_features))

    def _differentiable_product(self, x, values, bias) -> torch.Tensor:
        return sp24_linear(x, values, self.metadata, bias, self.out_features)

    def _product(self, x, values, bias) -> torch.Tensor:
        return forward_product(x, values, self.metadata, bias, self.out_features, self.epilogue)

    def likely_specs(self, arch: int, sm_count: int) -> list:
        """The kernels this layer's forward likely takes (sparsegen.warm builds them ahead)."""
        if self.values.dtype not in (torch.float16, torch.bfloat16):
            return []
        return list(dispatch.likely_specs(self.values.dtype, arch, sm_count, self.out_features, self.epilogue))

    def _lean_call(self, x: torch.Tensor, values: torch.Tensor, bias):
        calls.check_inputs(x, values, bias, self.in_features)
        plan = ops.sp24_lean_plan(x, values, self.metadata, self.out_features, self.epilogue)
        return None if plan is None else lean.LeanCall(plan, x, values, bias)

    def to_linear(self) -> nn.Module:
        """A dense nn.Linear with this layer's (2:4) weight, followed by the epilogue where one
        is fused (epilogues.DenseEpilogue)."""
        return self._dense_twin(dense_linear(self.to_dense_weight(), self.bias))

    # Tensor parallelism (layer.py's contract, sparsegen.parallel): whole 4-groups at the kernels'
    # K granule, rows in 16s; 2:4 metadata is laid out in tiles of 16 rows x 32 columns, so a
    # part's is the whole's rows or columns of tiles.
    TP_SHARDED = {0: ("values", "metadata", "bias"), 1: ("values", "metadata")}

    def tp_granules(self) -> tuple[int, int]:
        return 16, 64

    def tp_part(self, rows: slice, columns: slice, keep_bias: bool) -> "Sparse24Linear":
        part = Sparse24Linear.from_dense(weight_part(self, rows, columns), mask=self.mask[rows, columns])
        return finish_part(part, self, rows, keep_bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, sparsity=2:4, "
                f"bias={self.bias is not None}{self._epilogue_repr()}")
