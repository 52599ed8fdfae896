"""Every layer type sparsegen ships, small, for the copy/pickle/save tests (CPU and GPU)."""
import torch
from torch import nn

import sparsegen
from sparsegen.bdiag.nn import BlockDiagonalLinear
from sparsegen.bell.nn import BlockEllLinear

LAYER_KINDS = ["block-csr", "2:4", "2:4-training", "scaled-e4m3", "scaled-int8", "block-ell", "block-diagonal",
               "gated-mlp"]


def _linear(seed: int, features_in=128, features_out=192, device="cpu", dtype=torch.bfloat16) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(features_in, features_out, device=device, dtype=dtype)


class _LlamaMLP(nn.Module):
    """The shape of a Llama MLP, which sparsegen.patch fuses into a GatedMLP."""

    def __init__(self, device, dtype):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(1, 128, 192, device, dtype), _linear(2, 128, 192, device, dtype)
        self.down_proj, self.act_fn = _linear(3, 192, 128, device, dtype), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def make_layer(kind: str, device="cpu", dtype=torch.bfloat16) -> nn.Module:
    """A layer of `kind` ([*, 128] -> [*, 192] or, for gated-mlp, [*, 128]) on device."""
    dense = _linear(0, device=device, dtype=dtype)
    if kind == "block-csr":
        return sparsegen.BlockSparseLinear.from_dense(dense, block=(32, 32), density=0.5)
    if kind == "2:4":
        return sparsegen.Sparse24Linear.from_dense(dense)
    if kind == "2:4-training":
        return sparsegen.Sparse24TrainingLinear.from_dense(dense)
    if kind.startswith("scaled-"):
        return sparsegen.ScaledSparse24Linear.from_dense(dense, kind.removeprefix("scaled-"))
    if kind == "block-ell":
        return BlockEllLinear(128, 192, block=(32, 32), density=0.5, device=device, dtype=dtype)
    if kind == "block-diagonal":
        return BlockDiagonalLinear.from_dense(dense, 4)
    mlp = nn.Sequential(_LlamaMLP(device, dtype))
    sparsegen.patch(mlp, {r"0\.(gate|up|down)_proj": {"sparsity": "2:4"}})
    assert type(mlp[0]) is sparsegen.GatedMLP
    return mlp
