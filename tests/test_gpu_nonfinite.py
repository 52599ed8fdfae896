"""NaN and Inf on the GPU: in X, in the stored weights and in dY, they reach the same outputs
as in the float64 product the layer runs. sparsegen's kernels multiply stored weights only:
a stored zero times Inf is NaN, as in the dense product, but a pruned weight is never
multiplied, so a NaN in X does not cross it. cuBLAS on a dense W (the dense path, and dX of
2:4 and block-ELL layers) follows the dense product. Every kernel family, the split-K decode
and fused epilogues (pytest -m gpu)."""
import pytest
import torch

import sparsegen
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.jit import epilogues

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IN, OUT = 320, 192
BF16 = dict(device="cuda", dtype=torch.bfloat16)
LAYERS = {"2:4": lambda: sparsegen.Sparse24Linear(IN, OUT, **BF16),
          "2:4t": lambda: sparsegen.Sparse24Linear(IN, OUT, method="transposable", **BF16),
          "b16": lambda: sparsegen.linear(IN, OUT, block=(16, 16), density=0.5, **BF16),
          "b32": lambda: sparsegen.linear(IN, OUT, block=(32, 32), density=0.5, **BF16),
          "b64": lambda: sparsegen.linear(IN, OUT, block=(64, 64), density=0.5, **BF16),
          "bell": lambda: BlockEllLinear(IN, OUT, block=(32, 32), density=0.5, **BF16),
          "bdiag": lambda: sparsegen.linear(IN, OUT, sparsity="block-diagonal", nblocks=2, **BF16)}
TOKENS = (1, 7, 16, 300)  # decode (2:4 splits K), odd, and enough for the many-token kernels


@pytest.fixture(autouse=True)
def kernels_only(monkeypatch):
    """sparsegen's kernels, not cuBLAS on a dense copy (which is the dense product)."""
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "0")


def dense_of(layer, values: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] weight the layer's layout makes of `values` (its values, its grad)."""
    kept = layer.values.data
    layer.values.data = values
    try:
        return layer.to_dense_weight().detach().double()
    finally:
        layer.values.data = kept


def stored_mask(layer) -> torch.Tensor:
    return dense_of(layer, torch.ones_like(layer.values)) != 0


def over_stored(a: torch.Tensor, b: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """sum_k a[i, k] b[j, k] over the stored (j, k) only, in float64: NaN and Inf reach (i, j)
    exactly where they meet a stored position."""
    terms = a.double()[:, None, :] * b.double()[None, :, :]
    return torch.where(stored[None], terms, torch.zeros((), dtype=torch.float64, device=a.device)).sum(-1)


def poison(t: torch.Tensor, count: int = 2) -> torch.Tensor:
    """t with NaN, +Inf and -Inf at `count` random places each."""
    t = t.detach().clone()
    flat = t.view(-1)
    for value in (float("nan"), float("inf"), float("-inf")):
        flat[torch.randint(flat.numel(), (count,), device=t.device)] = value
    return t


def assert_same_nonfinite(out: torch.Tensor, ref: torch.Tensor) -> None:
    out = out.double()
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(out), kind(ref)), f"{kind.__name__}: {kind(out).sum()} against {kind(ref).sum()}"
    finite = torch.isfinite(ref)
    error = (out[finite] - ref[finite]).norm() / ref[finite].norm().clamp_min(1e-30)
    assert error < 2e-2


def with_poisoned(layer, x_poison: bool, w_poison: bool, tokens: int):
    torch.manual_seed(tokens)
    if w_poison:
        with torch.no_grad():
            layer.values.copy_(poison(layer.values, 1))
    x = torch.randn(tokens, IN, **BF16)
    return poison(x, 1) if x_poison else x


@pytest.mark.parametrize("where", ["x", "w", "both"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_forward_propagates_like_the_product_over_stored_weights(kind, tokens, where):
    layer = LAYERS[kind]()
    x = with_poisoned(layer, where != "w", where != "x", tokens)
    weight = dense_of(layer, layer.values.data)
    ref = over_stored(x, weight, stored_mask(layer)) + layer.bias.double()
    for _ in range(2):  # the planning call, then the planned (lean) one
        assert_same_nonfinite(layer(x), ref)


@pytest.mark.parametrize("epilogue", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("kind", ["2:4", "b64", "bell"])
@pytest.mark.parametrize("tokens", [16, 300])
@torch.no_grad()
def test_fused_epilogues_keep_nan_and_inf(kind, epilogue, tokens):
    layer = LAYERS[kind]().fuse(epilogue)
    x = with_poisoned(layer, True, True, tokens)
    product = over_stored(x, dense_of(layer, layer.values.data), stored_mask(layer)) + layer.bias.double()
    assert_same_nonfinite(layer(x), epilogues.reference(product, epilogue))


# dX by cuBLAS on the dense W (zeros where nothing is stored): the dense product's rule there.
# 2:4 runs its kernel on W^T only where W's positions are 2:4 along columns too (2:4t: a
# transposable mask, W^T storing W's positions - sp24_transpose);
# the kit's layouts (bell, bdiag) run block-CSR's kernel over W^T's stored blocks in eager calls.
DENSE_DX = {"2:4"}


@pytest.mark.parametrize("kind", ["2:4", "2:4t", "b32", "b64", "bell", "bdiag"])
def test_backward_propagates_like_the_product_it_runs(kind):
    """dX = dY W over the stored weights (the dense W where cuBLAS runs it) and dW = dY^T X at
    the stored positions, with NaN and Inf in X, W and dY."""
    layer = LAYERS[kind]()
    x = with_poisoned(layer, True, True, 256).requires_grad_(True)
    dy = poison(torch.randn(256, OUT, **BF16), 1)
    layer(x).backward(dy)
    stored, weight = stored_mask(layer), dense_of(layer, layer.values.data)
    dense_dx = dy.double() @ weight
    assert_same_nonfinite(x.grad, dense_dx if kind in DENSE_DX else over_stored(dy, weight.t(), stored.t()))
    dw = dense_of(layer, layer.values.grad)
    ref = torch.where(stored, dy.double().t() @ x.detach().double(), torch.zeros((), dtype=torch.float64, device="cuda"))
    assert_same_nonfinite(dw[stored], ref[stored])
