"""What the GPU reliability tests rest on, checked without a GPU: out-of-memory errors name
what sparsegen was allocating and keep nothing half-made; deterministic mode keeps split K."""
import ast
import pathlib

import pytest
import torch

from sparsegen.launch import dense_path, plans, workspace
from sparsegen.launch.memory import allocating
from sparsegen.semi24 import dispatch


def out_of_memory(*args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_allocating_names_what_and_keeps_pytorchs_error_type():
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with allocating("a split-K workspace", 3 << 20):
            out_of_memory()
    message = str(caught.value)
    assert message.startswith("sparsegen ran out of GPU memory allocating a split-K workspace (3.0 MiB)")
    assert "Tried to allocate 2.00 GiB" in message and isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_nested_allocations_are_named_once():
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with allocating("a launch plan"):
            with allocating("the dense copy"):
                out_of_memory()
    assert str(caught.value).count("sparsegen ran out") == 1 and "the dense copy" in str(caught.value)


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="^bad$"):
        with allocating("anything"):
            raise ValueError("bad")


def test_failed_workspace_allocation_keeps_nothing(monkeypatch):
    monkeypatch.setattr(workspace, "_WORKSPACES", {})
    device = torch.device("cpu")
    with pytest.raises(torch.OutOfMemoryError, match="split-K workspace"):
        workspace.held(device, 7, 100, 3, out_of_memory)
    assert workspace.current(device, 7) is None
    made = workspace.held(device, 7, 100, 3, lambda n, dtype, d: torch.zeros(n, dtype=dtype, device=d))
    assert made.sums.numel() == 100 and made.counts.dtype == torch.int32 and workspace.current(device, 7) is made


def test_failed_plan_is_not_kept_and_the_next_call_plans_again():
    cache, owner, made = plans.PlanCache(), torch.zeros(3), []
    with pytest.raises(torch.OutOfMemoryError, match="launch plan"):
        cache.get(owner, ("sig",), lambda: out_of_memory())
    plan = cache.get(owner, ("sig",), lambda: made.append(1) or "plan")
    assert plan == "plan" and cache.get(owner, ("sig",), lambda: "other") == "plan" and made == [1]


def test_failed_dense_copy_is_not_kept_and_the_next_call_builds_it():
    key, values = torch.zeros(2), torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(torch.OutOfMemoryError, match="dense copy of a sparse weight .*unset SPARSEGEN_DENSE_FALLBACK"):
        dense_path.copy_of(key, values, out_of_memory, values)
    assert key not in dense_path._COPIES
    weight = dense_path.copy_of(key, values, lambda v: v * 2, values)
    assert torch.equal(weight, values.detach() * 2) and dense_path._COPIES[key].weight is weight


def test_k_splits_are_kept_in_deterministic_mode_and_int8_never_splits():
    """Split K adds every split's slice in split order (templates/sg_split_k.cuh): deterministic."""
    torch.use_deterministic_algorithms(True)
    try:
        assert dispatch.wanted_splits(None, torch.bfloat16) is None and dispatch.wanted_splits(4, torch.float16) == 4
    finally:
        torch.use_deterministic_algorithms(False)
    assert dispatch.wanted_splits(4, torch.int8) == 1  # (its int32 sums must not pass through float32)


def test_every_test_the_sanitize_step_names_exists():
    """tools/sanitize_tests.txt names test functions; a renamed one would make pytest stop
    with 'not found' under every tool (the step then checks nothing)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    lines = (root / "tools" / "sanitize_tests.txt").read_text().splitlines()
    for path, name in (line.split("::") for line in lines if line.strip() and not line.startswith("#")):
        tree = ast.parse((root / path).read_text())
        assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, f"{path}::{name}"
