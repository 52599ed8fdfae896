"""Host cost of the pieces a linear call is made of, on this machine (us per call, median of
rounds): torch's own queries and allocations, our launch, and whole calls of each layer kind.
The profile behind the lean call path (issue #13, item 2). Run on a GPU:
PYTHONPATH=. python tools/probe_host.py"""
import statistics
import struct
import sys
import time

import torch
from torch import nn

import sparsegen
from sparsegen.launch import runtime
from sparsegen.bsr import compiled as bsr_compiled
from sparsegen.bsr import ops as bsr_ops

CALLS, ROUNDS = 300, 15  # few enough calls a round that launches never wait for the GPU


def us_per_call(fn, calls: int = CALLS) -> float:
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) / calls * 1e6


def pieces(x: torch.Tensor, layer: nn.Module) -> dict:
    """Each callable: one piece of host work a forward call may do."""
    dense = nn.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16)
    plan = next(iter(bsr_ops._PLANS._plans.values()))[1]
    y = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    buffer = bytearray(64)
    return {
        "nn.Linear(x)": lambda: dense(x),
        "F.linear(x, w, b)": lambda: torch.nn.functional.linear(x, dense.weight, dense.bias),
        "torch.mm(x, wT, out=y)": lambda: torch.mm(x, dense.weight.t(), out=y),
        "torch.empty(16, 1024, dtype, device=x.device)": lambda: torch.empty(16, 1024, dtype=x.dtype, device=x.device),
        "torch.empty((16, 1024), dtype, device=dev)": lambda: torch.empty((16, 1024), dtype=x.dtype, device=y.device),
        "x.new_empty((16, 1024))": lambda: x.new_empty((16, 1024)),
        "x.data_ptr()": x.data_ptr,
        "x.device": lambda: x.device,
        "x.get_device()": x.get_device,
        "x.shape": lambda: x.shape,
        "x.dtype": lambda: x.dtype,
        "x.is_contiguous()": x.is_contiguous,
        "x.requires_grad": lambda: x.requires_grad,
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "_is_any_autocast_enabled()": torch._C._is_any_autocast_enabled,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "runtime.current_stream(0)": lambda: runtime.current_stream(0),
        "runtime.current_device()": runtime.current_device,
        "struct.pack_into(3Q3i)": lambda: struct.pack_into("3Q3i", buffer, 0, 1, 2, 3, 4, 5, 6),
        "plan.run(x, values, bias, y)": lambda: plan.run(x, layer.values, layer.bias, y),
        "plan.launch.run() (bound parameters)": plan.launch.run,
        "lean call (layer._lean_forward(x))": lambda: layer._lean_forward(x),
        "bsr_ops.bsr_dds(...)": lambda: bsr_ops.bsr_dds(x, layer.values, layer.row_offsets, layer.col_indices, layer.bias, layer.block, 1024),
        "bsr.compiled.bsr_dds_into(..., out=y)": lambda: bsr_compiled.bsr_dds_into(x, layer.values, layer.bias, layer.row_offsets, layer.col_indices, layer.flat_index, 64, 64, 1024, "none", out=y),
        "layer(x) BlockSparseLinear": lambda: layer(x),
        "empty module call": _empty_module(),
    }


def compiled_launches() -> dict:
    """A compiled decode step's launch of one product (Llama-3-8B's q_proj, 8 tokens, split K)
    as Inductor's wrapper makes it, against the cuBLAS call a dense graph makes there."""
    from sparsegen.semi24 import compiled as sp24_compiled, scaled
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
    sp24 = sparsegen.linear(4096, 4096, sparsity="2:4", bias=False).to("cuda", torch.bfloat16)
    fp8 = scaled.ScaledSparse24Linear.from_dense(nn.Linear(4096, 4096, bias=False, device="cuda"), "e4m3")
    xq, x_scale = scaled.quantized_activations(x, fp8.values, None)
    return {
        "extern mm: torch.mm(x, wT, out=y) 8x4096x4096": lambda: torch.mm(x, dense.t(), out=y),
        "extern sp24_dds_into(..., out=y) 8x4096x4096": lambda: sp24_compiled.sp24_dds_into(
            x, sp24.values, sp24.metadata, None, 4096, "none", out=y),
        "extern sp24_scaled_dds_into(..., out=y) e4m3": lambda: sp24_compiled.sp24_scaled_dds_into(
            xq, fp8.values, fp8.metadata, x_scale, fp8.weight_scale, None, "none", torch.bfloat16, out=y),
    }


def _empty_module():
    class Empty(nn.Module):
        def forward(self, x):
            return x
    module, t = Empty(), torch.zeros(())
    return lambda: module(t)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    layer = sparsegen.linear(1024, 1024, block=(64, 64), density=0.5).to("cuda", torch.bfloat16)
    sp24 = sparsegen.linear(1024, 1024, sparsity="2:4").to("cuda", torch.bfloat16)
    with torch.no_grad():
        layer(x), sp24(x)
        rows = {name: us_per_call(fn) for name, fn in pieces(x, layer).items()}
        rows["layer(x) Sparse24Linear"] = us_per_call(lambda: sp24(x))
        for name, fn in compiled_launches().items():
            fn()
            rows[name] = us_per_call(fn)
    print("| piece | host us per call |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
