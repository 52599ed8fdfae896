"""Launch plans (sparsegen.launch.plans) and the ops a compiled graph calls."""
import gc

import torch

import sparsegen
from sparsegen.launch.plans import PlanCache


def test_plan_is_made_once_per_owner_and_signature():
    cache, owner, made = PlanCache(), torch.zeros(3), []
    make = lambda: made.append(1) or len(made)
    assert cache.get(owner, (16, "bf16"), make) == 1
    assert cache.get(owner, (16, "bf16"), make) == 1
    assert cache.get(owner, (32, "bf16"), make) == 2
    assert cache.get(torch.zeros(3), (16, "bf16"), make) == 3  # another layout: its own plan


def test_plans_go_with_their_owner():
    """A plan points into its layout's tensors: it must never serve another tensor, even one
    that Python later puts at the same id()."""
    cache = PlanCache()
    owner = torch.zeros(3)
    cache.get(owner, (1,), lambda: "old")
    del owner
    gc.collect()
    assert not cache._plans
    assert cache.get(torch.zeros(3), (1,), lambda: "new") == "new"


def test_compiled_inference_graph_calls_the_op_directly():
    """Inference under torch.compile: the traced graph holds sparsegen::bsr_dds itself (the
    dispatcher calls our code: no autograd wrapper in Python), and its output is the eager one."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    layer = sparsegen.linear(64, 32, block=(16, 16), density=0.5)
    x = torch.randn(5, 64)
    with torch.no_grad():
        got = torch.compile(layer, backend=backend, fullgraph=True)(x)
        torch.testing.assert_close(got, layer(x))
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert "sparsegen.bsr_dds.default" in targets, targets


def test_packed_launch_binds_parameters_in_kernel_order():
    """Parameter i is the i-th TMA map, or past the maps a pointer; the void*[] the driver
    reads points at each value (maps are bound on a GPU, test_gpu_lean.py)."""
    import ctypes

    from sparsegen.launch.runtime import PackedLaunch

    launch = PackedLaunch(kern=None, grid=(1, 1, 1), maps=((torch.bfloat16, 8, 8, 8, 8),), pointers=(0, 0, 7),
                          ints=(3, 4))
    launch.bind(1, 0xABC0)
    launch.bind(2, 0xDEF0)
    assert list(launch.pointers) == [0xABC0, 0xDEF0, 7]
    read = [ctypes.c_uint64.from_address(launch.array[i]).value for i in (1, 2, 3)]
    assert read == [0xABC0, 0xDEF0, 7]
    assert [ctypes.c_int32.from_address(launch.array[i]).value for i in (4, 5)] == [3, 4]
