"""Grouped 2:4 products (sparsegen/semi24/grouped.py) on the GPU: several weights of one X in
one launch, each weight's columns against float64 with Y poisoned first; the products one by
one where the grouped kernel does not apply; a compiled layer's q, k and v in one launch, in
plain compile and under CUDA graphs."""
import pytest
import torch
from torch import nn
from torch._inductor import config
from torch._inductor.utils import run_and_get_code

import sparsegen
from sparsegen.semi24 import format as semi24
from sparsegen.semi24 import compiled, grouped
from sparsegen.semi24.scaled import quantize, row_scales, scaled_reference

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

ARCH = torch.cuda.get_device_capability()
HOPPER = ARCH == (9, 0)
DTYPES = ["bf16", "fp16", "int8"] + (["e4m3"] if ARCH >= (8, 9) else [])
SIXTEEN = {"bf16": torch.bfloat16, "fp16": torch.float16}


def relative_error(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def group_operands(m: int, k: int, widths: tuple, dtype: str):
    """(launcher args but the constants, per weight its float64 reference of Y's columns, scaled)."""
    layers = [_layer(k, n, dtype) for n in widths]
    if dtype in SIXTEEN:
        x = torch.randn(m, k, device="cuda", dtype=SIXTEEN[dtype])
        refs = [x.double() @ semi24.decompress(l.values, l.metadata, (n, k)).double().t() for l, n in zip(layers, widths)]
        return [x, *[t for l in layers for t in (l.values, l.metadata)]], refs, False
    x = torch.randn(m, k, device="cuda") * 2
    x_scale = row_scales(x, layers[0].values.dtype) * torch.rand(m, device="cuda").add(0.5)
    xq = quantize(x, x_scale, layers[0].values.dtype)
    refs = [scaled_reference(xq, l.values, l.metadata, x_scale, l.weight_scale, None) for l in layers]
    return [xq, x_scale, *[t for l in layers for t in (l.values, l.metadata, l.weight_scale)]], refs, True


def _layer(k: int, n: int, dtype: str):
    if dtype in SIXTEEN:
        return sparsegen.Sparse24Linear(k, n, bias=False, device="cuda", dtype=SIXTEEN[dtype])
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    return sparsegen.ScaledSparse24Linear.from_dense(linear, dtype)


def launched(args: list, scaled: bool, out_dtype: torch.dtype, widths: tuple) -> torch.Tensor:
    out = torch.full((args[0].shape[0], sum(widths)), float("nan"), device="cuda", dtype=out_dtype)
    compiled.sp24_group_into(*args, scaled, "none", out=out)
    return out


def check_columns(out: torch.Tensor, refs: list, widths: tuple) -> None:
    assert not out.isnan().any()
    at = 0
    for ref, n in zip(refs, widths):
        assert relative_error(out[:, at:at + n], ref) < 5e-3, (at, n)
        at += n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, widths", [
    (1, 4096, (4096, 1024, 1024)), (5, 640, (256, 128, 80)), (32, 4096, (1024, 1024)),  # decode, K split
    (33, 1024, (512, 256, 208)), (77, 1024, (2048, 512, 512)), (333, 512, (256, 256, 208)), (2100, 256, (128, 144))])
def test_one_launch_gives_each_weights_columns(dtype, m, k, widths):
    """Every weight's columns against its own float64 product; on Hopper the grouped kernel ran."""
    args, refs, scaled = group_operands(m, k, widths, dtype)
    out_dtype = SIXTEEN.get(dtype, torch.bfloat16)
    out = launched(args, scaled, out_dtype, widths)
    check_columns(out, refs, widths)
    if HOPPER:  # (every weight but the last fills whole tiles of any tile these shapes take)
        weights = grouped.weights_of(tuple(args[2 if scaled else 1:]), scaled)
        code = 1 if scaled else 0
        assert grouped.group_plan(args[0], weights, "none", code) is not None


@pytest.mark.parametrize("dtype", ["bf16", DTYPES[-1]])
def test_weights_off_the_tiles_run_one_by_one(dtype):
    """A first weight of 96 rows ends inside a tile: no grouped plan, the same columns."""
    widths = (96, 64, 128)
    args, refs, scaled = group_operands(9, 512, widths, dtype)
    weights = grouped.weights_of(tuple(args[2 if scaled else 1:]), scaled)
    assert grouped.group_plan(args[0], weights, "none", 1 if scaled else 0) is None
    check_columns(launched(args, scaled, SIXTEEN.get(dtype, torch.bfloat16), widths), refs, widths)


class Projections(nn.Module):
    """A norm, then q, k and v of its output (an attention's projections)."""

    def __init__(self, dtype: str, hidden=512, kv=128):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, device="cuda", dtype=torch.bfloat16)
        self.q, self.k, self.v = (_layer(hidden, n, dtype) for n in (hidden, kv, kv))

    def forward(self, x):
        y = self.norm(x)
        return self.q(y), self.k(y), self.v(y)


@pytest.mark.parametrize("dtype", ["bf16", DTYPES[-1]])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_projections_are_one_launch_and_match_eager(dtype, mode, monkeypatch):
    """Outside CUDA graphs (plain compile) on Hopper the grouped kernel runs, never the products
    one by one; a graph's capture takes them one by one (their launchers' dense path)."""
    model = Projections(dtype)
    x = torch.randn(4, 8, 512, device="cuda", dtype=torch.bfloat16)
    one_by_one = []
    original = compiled._one_by_one
    monkeypatch.setattr(compiled, "_one_by_one", lambda *args: one_by_one.append(1) or original(*args))
    torch._dynamo.reset()
    with torch.no_grad(), config.patch(force_disable_caches=True):
        step = torch.compile(model, mode=mode)
        got, (source, *_) = run_and_get_code(step, x)
        for _ in range(2):  # CUDA graphs: recorded, then replayed
            got = [t.clone() for t in step(x)]
        want = model(x)
    assert source.count("extern_kernels.sparsegen_sp24_group(") == 1, source
    if HOPPER and mode == "default":
        assert not one_by_one
    for g, w in zip(got, want):
        # Inductor quantizes the norm's float32 result, eager mode its bf16 rounding
        assert relative_error(g, w.double()) < (2e-2 if dtype != "bf16" else 2e-3)
