"""BlockSparseLinear: a drop-in nn.Linear whose weight is block-sparse."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..launch import calls, lean
from .. import checkpoint
from ..jit import epilogues
from ..errors import expect, fraction, positive_int
from ..layer import SparseLinearForward, dense_linear, finish_part, in_units, layer_dtype, weight_part
from . import format as bsr
from . import ops
from .specs import call_variants, forward_spec, scatter_spec
from .autograd import INDEX_NAMES, IndexTensors, block_sparse_linear, forward_product


SAVED_INDEX = ("row_offsets", "col_indices")  # saved with the layout (the rest is derived)


class BlockSparseLinear(SparseLinearForward, lean.LeanLayer, epilogues.Fusable, checkpoint.CheckedLoad, nn.Module):
    """y = x W^T + b with W [out, in] stored as block-CSR blocks of shape `block`.

    `layout` (a bool tensor [out/bm, in/bk]) fixes which blocks exist; otherwise a random
    layout at `density` is drawn (rounded to whole blocks, no empty block row).
    `fuse(epilogue)` applies an activation or a gated product in the kernel (epilogues.py).
    """

    def __init__(self, in_features: int, out_features: int, block=(32, 32), density: float = 0.5,
                 bias: bool = True, device=None, dtype=None, layout: torch.Tensor | None = None):
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        self.block = bsr.check_block(block)
        grid = bsr.grid_shape(self.out_features, self.in_features, self.block)
        mask = (bsr.random_mask(grid, fraction(density, "density", zero=False)) if layout is None
                else bsr.check_mask(layout, grid))
        factory = dict(device=device, dtype=layer_dtype(dtype) or torch.get_default_dtype())
        self.register_buffer("layout", mask.to(device))
        self._register_index(mask, device)
        self.values = nn.Parameter(torch.empty(int(mask.sum()), *self.block, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's uniform bound, on the fan-in the kept blocks actually give each output.
        fan_in = max(1.0, self.density * self.in_features)
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.values, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def mask(self) -> torch.Tensor:
        """Boolean block mask [out/bm, in/bk]."""
        return self.layout

    @property
    def density(self) -> float:
        # (the stored blocks' count from the values' shape: no host sync, and a layer built
        # on the meta device has one too)
        return self.values.shape[0] / max(1, self.layout.numel())

    def to_dense_weight(self) -> torch.Tensor:
        return bsr.scatter_blocks(self.values, self.flat_index, (self.out_features, self.in_features),
                                  self.block)

    def _register_index(self, mask: torch.Tensor, device) -> None:
        """row_offsets and col_indices are saved with the layout; the rest (W^T's index, block
        positions) is derived, so it is rebuilt on load instead of stored."""
        self._forget_lean_calls()
        index = IndexTensors.of(mask, device)
        for name, tensor in vars(index).items():
            self.register_buffer(name, tensor, persistent=name in SAVED_INDEX)

    _rebuilt = SAVED_INDEX  # pointers into X and W: a file's are never used, the layout's are

    def _check_state(self, state_dict: dict, prefix: str) -> None:
        """A saved layout is adopted with its values; one with another number of blocks is
        refused before anything is copied, so the layer is never left half-loaded."""
        layout = state_dict.get(prefix + "layout")
        if isinstance(layout, torch.Tensor) and layout.dtype == torch.bool and layout.shape == self.layout.shape:
            expect(int(layout.sum()) == self.values.shape[0], f"state_dict['{prefix}layout'] with this layer's "
                   f"{self.values.shape[0]} blocks (build the layer with layout=state_dict['{prefix}layout'] "
                   "to load another)", int(layout.sum()))

    def _after_load(self) -> None:
        self._register_index(self.layout, self.layout.device)  # the loaded layout's index

    def _index(self) -> tuple:
        return tuple(getattr(self, name) for name in INDEX_NAMES)

    def _differentiable_product(self, x, values, bias) -> torch.Tensor:
        return block_sparse_linear(x, values, bias, self._index(), self.block, self.out_features)

    def _product(self, x, values, bias) -> torch.Tensor:
        return forward_product(x, values, bias, self.row_offsets, self.col_indices, self.flat_index, self.block,
                               self.out_features, self.epilogue)

    def likely_specs(self, arch: int, sm_count: int) -> list:
        """The kernels this layer's forward takes at any token count (sparsegen.warm builds them
        ahead when patch makes the layer): decode's (64 tokens or fewer) and larger calls', each
        with the variants a call may pick (specs.call_variants), and the dense path's scatter."""
        name = calls.DTYPE_NAMES.get(self.values.dtype)
        if name is None:
            return []
        forward = [forward_spec(self.block, name, arch, rows=rows, epilogue=self.epilogue) for rows in (1, None)]
        return [v for spec in forward for v in call_variants(spec)] + [scatter_spec(self.block, name, arch)]

    def _lean_call(self, x: torch.Tensor, values: torch.Tensor, bias):
        calls.check_inputs(x, values, bias, self.in_features)
        plan = ops.bsr_lean_plan(x, values, self.row_offsets, self.col_indices, self.block, self.out_features,
                                 self.epilogue)
        return None if plan is None else lean.LeanCall(plan, x, values, bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, block=(32, 32), density: float = 0.5,
                   layout: torch.Tensor | None = None) -> "BlockSparseLinear":
        """Keep the blocks of `linear.weight` with the largest norm (or those in `layout`)."""
        expect(isinstance(linear, nn.Linear), "an nn.Linear", type(linear).__name__)
        weight = linear.weight.detach()
        block = bsr.check_block(block)
        bsr.grid_shape(linear.out_features, linear.in_features, block)  # clear error first
        mask = layout if layout is not None else bsr.top_norm_mask(weight, block, fraction(density, "density", zero=False))
        layer = cls(linear.in_features, linear.out_features, block, bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype, layout=mask)
        with torch.no_grad():
            layer.values.copy_(bsr.dense_to_values(weight, layer.layout, layer.block))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    @torch.no_grad()
    def set_layout(self, mask: torch.Tensor, optimizer=None) -> None:
        """Switch to another layout with the same number of blocks. Blocks in both keep their
        values (and, in `optimizer`, their state); new blocks start at zero."""
        grid = tuple(self.layout.shape)
        mask = bsr.check_mask(mask, grid)
        expect(int(mask.sum()) == self.values.shape[0],
               f"a layout with the layer's {self.values.shape[0]} blocks", int(mask.sum()))
        source = torch.full((mask.numel(),), -1, dtype=torch.long)
        source[self.flat_index.cpu()] = torch.arange(self.values.shape[0])
        source = source[bsr.flat_index(mask)].to(self.values.device)  # old position, or -1
        for tensor in [self.values] + _state_like(optimizer, self.values):
            tensor.copy_(_moved(tensor, source))
        self.layout.copy_(mask.to(self.layout.device))
        self._register_index(mask, self.layout.device)

    def to_linear(self) -> nn.Module:
        """A dense nn.Linear with this layer's weights (zeros where blocks are absent), followed
        by the epilogue where one is fused (epilogues.DenseEpilogue)."""
        return self._dense_twin(dense_linear(self.to_dense_weight(), self.bias))

    # Tensor parallelism (layer.py's contract, sparsegen.parallel): whole blocks. A part holds a
    # share of the blocks no DTensor describes: no TP_SHARDED, so its state_dict is refused.
    def tp_granules(self) -> tuple[int, int]:
        return self.block

    def tp_part(self, rows: slice, columns: slice, keep_bias: bool) -> "BlockSparseLinear":
        layout = self.layout[in_units(rows, self.block[0]), in_units(columns, self.block[1])]
        part = BlockSparseLinear.from_dense(weight_part(self, rows, columns), block=self.block, layout=layout)
        return finish_part(part, self, rows, keep_bias)

    def extra_repr(self) -> str:
        nnz, total = int(self.layout.sum()), self.layout.numel()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block}, density={self.density:.3f} ({nnz}/{total} blocks), "
                f"bias={self.bias is not None}{self._epilogue_repr()}")


def _moved(tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """tensor's blocks in a new order: block i from source[i], zeros where source is -1."""
    kept = source >= 0
    out = torch.zeros_like(tensor)
    out[kept] = tensor[source[kept]]
    return out


def _state_like(optimizer, param: torch.Tensor) -> list:
    """The optimizer's per-element state of `param` (Adam's moments, SGD's momentum...)."""
    if optimizer is None:
        return []
    state = optimizer.state.get(param, {})
    return [t for t in state.values() if isinstance(t, torch.Tensor) and t.shape == param.shape]
