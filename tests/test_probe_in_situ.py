"""tools/probe_in_situ.py's mechanics on the CPU: it counts the calls of a kind a step makes
through Inductor's extern_kernels, skips them while asked, and puts them back after."""
import importlib.util
import sys
from pathlib import Path

import torch
from torch._inductor.select_algorithm import extern_kernels

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool():
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("probe_in_situ", TOOLS / "probe_in_situ.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calls_are_counted_skipped_while_asked_and_put_back():
    tool = load_tool()
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    out = torch.full((3, 5), float("nan"))

    def step():  # two products, as a graph's wrapper makes them
        extern_kernels.mm(a, b, out=out)
        extern_kernels.mm(a, b, out=out)
    original = extern_kernels.mm
    assert tool.calls_per_step(step, tool.names_of("cuBLAS (extern mm, addmm)")) == 2
    assert torch.allclose(out, a @ b) and extern_kernels.mm is original
    out.fill_(float("nan"))
    tool.without(step, ["mm"])()
    assert out.isnan().all() and extern_kernels.mm is original
    assert tool.names_of("cuBLAS (extern mm, addmm)") == ["addmm", "mm"]


def test_census_counts_each_function_per_step_and_keeps_to_sparsegen_unless_asked():
    from sparsegen.launch import calls
    tool = load_tool()

    def outside():  # not sparsegen's
        return None

    def step():
        calls.kernel_left_to_dispatch()
        calls.kernel_left_to_dispatch()
        outside()
    def other():
        calls.kernel_left_to_dispatch()
    ours = tool.census({"step": step, "other": other}, count=3)
    assert [(count, where.rsplit("(", 1)[-1]) for count, _, where in ours["step"]] == [(2.0, "kernel_left_to_dispatch)")]
    assert [count for count, _, _ in ours["other"]] == [1.0]  # (each step its own profiler)
    every = tool.census({"step": step}, count=3, everything=True)
    assert [count for count, _, where in every["step"] if where.endswith("(outside)")] == [1.0]
