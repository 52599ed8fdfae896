"""Launch plans (sparsegen.launch.plans) and the ops a compiled graph calls."""
import gc

import pytest
import torch

import sparsegen
from sparsegen.launch import plans
from sparsegen.launch.plans import PlanCache, SignatureCache

ON_EVERY_DEVICE = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])]


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


def test_signature_plans_serve_any_operands_and_go_when_plans_are_forgotten(monkeypatch):
    cache, made = SignatureCache(), []
    make = lambda: made.append(1) or len(made)
    assert [cache.get((16, "bf16"), make), cache.get((16, "bf16"), make), cache.get((32, "bf16"), make)] == [1, 1, 2]
    plans.forget_all()  # (a crossover table reloaded: every decision again)
    assert cache.get((16, "bf16"), make) == 3
    monkeypatch.setattr(SignatureCache, "MAX_SIGNATURES", 4)
    for tokens in range(10):  # a stream of new shapes keeps at most MAX_SIGNATURES plans
        cache.get((tokens,), make)
        assert len(cache._plans) <= 4


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

    launch = PackedLaunch(_FakeKernel(), grid=(1, 1, 1), maps=((torch.bfloat16, 8, 8, 8, 8),), pointers=(0, 0, 7),
                          ints=(3, 4))
    launch.bind(1, 0xABC0)
    launch.bind(2, 0xDEF0)
    assert list(launch.pointers) == [0xABC0, 0xDEF0, 7]
    read = [ctypes.c_uint64.from_address(launch.array[i]).value for i in (1, 2, 3)]
    assert read == [0xABC0, 0xDEF0, 7]
    assert [ctypes.c_int32.from_address(launch.array[i]).value for i in (4, 5)] == [3, 4]


class _FakeKernel:
    """What PackedLaunch reads of a loaded kernel; launch_array records the general path."""
    threads, smem, device_index, _handle = 256, 49152, 0, 0xF00

    def __init__(self):
        self.general = []

    def launch_array(self, grid, array):
        self.general.append(grid)


def _packed_with_driver(monkeypatch, status: int, device: int = 0):
    """A PackedLaunch whose cuLaunchKernelEx is a recorder returning `status`, on a stream
    0x5000 of device `device` (the launch's kernel is on device 0)."""
    import ctypes

    from sparsegen.launch import runtime

    calls = []

    def launch_ex(config_address, function, array, extra):
        config = runtime._LaunchConfig.from_address(config_address)
        calls.append((config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX, config.sharedMemBytes,
                      config.hStream, function, ctypes.c_uint64.from_address(array[0]).value, extra))
        return status

    monkeypatch.setattr(runtime, "_launch_ex", lambda: launch_ex)
    monkeypatch.setattr(runtime, "current_device", lambda: device)
    monkeypatch.setattr(runtime, "current_stream", lambda index: 0x5000 + index)
    kern = _FakeKernel()
    launch = runtime.PackedLaunch(kern, grid=(7, 3, 1), maps=(), pointers=(0,), ints=(5,))
    launch.bind(0, 0xAB00)
    return launch, kern, calls


def test_packed_launch_goes_through_launch_ex_with_its_grid_block_and_stream(monkeypatch):
    launch, kern, calls = _packed_with_driver(monkeypatch, status=0)
    launch.run()
    assert calls == [(7, 3, 1, 256, 49152, 0x5000, 0xF00, 0xAB00, None)] and kern.general == []


def test_a_failed_launch_ex_takes_the_general_path_which_reports_it(monkeypatch):
    """A thread without a current context (status 201), or any failure: cuLaunchKernel's
    path sets the context or raises with the driver's name for the error."""
    launch, kern, calls = _packed_with_driver(monkeypatch, status=201)
    launch.run()
    assert len(calls) == 1 and kern.general == [(7, 3, 1)]


def test_a_launch_from_another_current_device_takes_the_general_path(monkeypatch):
    launch, kern, calls = _packed_with_driver(monkeypatch, status=0, device=1)
    launch.run()
    assert calls == [] and kern.general == [(7, 3, 1)]


def test_an_index_rewritten_in_place_with_its_own_values_is_not_derived_again():
    """DistributedDataParallel rewrites every buffer before each forward (the same values, a
    new version): what a layer derived from its index stays; a real change is derived again."""
    from sparsegen.launch import calls
    index = torch.randint(0, 100, (64,), dtype=torch.int32)
    builds = []

    def derive(t, scale):
        builds.append(1)
        return t * scale

    first = calls.per_layout("doubled", index, derive, index, 2)
    index.copy_(index.clone())                 # the broadcast: same values, version moved
    assert calls.per_layout("doubled", index, derive, index, 2) is first and len(builds) == 1
    index[3] += 1                              # a real edit in place
    again = calls.per_layout("doubled", index, derive, index, 2)
    assert len(builds) == 2 and torch.equal(again, index * 2)
    assert calls.per_layout("doubled", index, derive, index, 3) is not again and len(builds) == 3


def doubling_counted(builds: list):
    """A derivation (t -> 2t) that records each call in builds."""
    def derive(t):
        builds.append(1)
        return t * 2
    return derive


def rewritten(indexes) -> None:
    """Each index rewritten in place with its own values, as DDP's buffer broadcast does."""
    for t in indexes:
        t.copy_(t.clone())


def test_a_rewrite_of_every_index_is_checked_once_for_all_layers(monkeypatch):
    """DDP rewrites every layer's index before the forward: the first layer's check compares
    them all at once (one host sync on a GPU), the later layers find theirs verified."""
    from sparsegen.launch import calls, kept_index
    indexes = [torch.randint(0, 100, (64 + i,), dtype=torch.int32) for i in range(5)]
    builds, checks, check = [], [], kept_index._check_every_moved_index
    monkeypatch.setattr(kept_index, "_check_every_moved_index", lambda: checks.append(1) or check())
    derive = doubling_counted(builds)

    first = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    rewritten(indexes)
    assert all(calls.per_layout("doubled", t, derive, t) is f for t, f in zip(indexes, first))
    assert len(builds) == 5 and len(checks) == 1
    indexes[2][0] += 1                          # one real change among the rewrites
    rewritten(indexes[3:])
    again = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    assert len(builds) == 6 and len(checks) == 2
    assert torch.equal(again[2], indexes[2] * 2) and all(again[i] is first[i] for i in (0, 1, 3, 4))


def test_everything_derived_from_a_changed_index_is_derived_again():
    """Two things derived from one index: the first rebuilt after a change makes a new copy of
    the index, and the second must not take that copy for the values it was derived from."""
    from sparsegen.launch import calls
    index = torch.randint(0, 100, (64,), dtype=torch.int32)
    calls.per_layout("doubled", index, lambda t: t * 2, index)
    calls.per_layout("tripled", index, lambda t: t * 3, index)
    index[5] += 7
    assert torch.equal(calls.per_layout("doubled", index, lambda t: t * 2, index), index * 2)
    assert torch.equal(calls.per_layout("tripled", index, lambda t: t * 3, index), index * 3)


def test_the_transposable_answer_survives_a_rewrite_and_follows_a_change(monkeypatch):
    """2:4 metadata rewritten with its own values keeps its answer; new metadata (a magnitude
    mask, not 2:4 along columns) gets a new one."""
    from sparsegen.semi24 import autograd, format as semi24
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    both_ways, by_rows = semi24.transposable_mask(weight), semi24.magnitude_mask(weight)
    _, metadata = semi24.compress(weight * both_ways, both_ways)
    _, other = semi24.compress(weight * by_rows, by_rows)
    checks, columns_24 = [], autograd._columns_24
    monkeypatch.setattr(autograd, "_columns_24", lambda *args: checks.append(1) or columns_24(*args))
    assert autograd.stored_transposable(metadata, 32, 64)
    metadata.copy_(metadata.clone())
    assert autograd.stored_transposable(metadata, 32, 64) and len(checks) == 1
    metadata.copy_(other)
    assert not autograd.stored_transposable(metadata, 32, 64) and len(checks) == 2


def counted_sync_checks(monkeypatch) -> list:
    """Each comparison kept_index.current makes on the spot (a host sync on a GPU), recorded."""
    from sparsegen.launch import kept_index
    checks, check = [], kept_index._check_every_moved_index
    monkeypatch.setattr(kept_index, "_check_every_moved_index", lambda: checks.append(1) or check())
    return checks


@pytest.mark.parametrize("device", ON_EVERY_DEVICE)
def test_a_started_check_answers_for_every_moved_index_without_a_check_on_the_spot(monkeypatch, device):
    """start_check (a 2:4 forward's) compares every rewritten index at once; the layers that
    ask later read its answers (on a GPU from host memory, after its event): a rewrite keeps
    what was derived, a real change among the rewrites derives again, and nothing is compared
    on the spot."""
    from sparsegen.launch import calls, kept_index
    indexes = [torch.randint(0, 100, (40 + i,), dtype=torch.int32, device=device) for i in range(4)]
    builds, checks = [], counted_sync_checks(monkeypatch)
    derive = doubling_counted(builds)
    first = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    rewritten(indexes)
    indexes[1][-1] += 1
    kept_index.start_check(indexes[3])
    kept_index.start_check(indexes[0])          # (covered by the check already started)
    again = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    assert checks == [] and len(builds) == 5
    assert torch.equal(again[1], indexes[1] * 2) and all(again[i] is first[i] for i in (0, 2, 3))


def test_an_index_that_moves_after_the_check_started_is_compared_again(monkeypatch):
    """The started answers hold for the stamps they were taken at: an index changed (or only
    rewritten) after the start is compared on the spot when asked, and found as it is."""
    from sparsegen.launch import calls, kept_index
    indexes = [torch.randint(0, 100, (40,), dtype=torch.int64) for _ in range(3)]
    builds, checks = [], counted_sync_checks(monkeypatch)
    derive = doubling_counted(builds)
    first = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    rewritten(indexes)
    kept_index.start_check(indexes[0])
    indexes[0][0] += 1                          # changed after the start: the answer "same" is stale
    rewritten(indexes[2:])                      # moved again, same values
    again = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    assert len(checks) == 1 and len(builds) == 4
    assert torch.equal(again[0], indexes[0] * 2) and again[1] is first[1] and again[2] is first[2]


def test_a_started_check_keeps_no_index_alive():
    """The started check holds its indices and their copies weakly: a layer dropped before
    its answers are read takes its memory with it, and the answers of the others still hold."""
    import weakref
    from sparsegen.launch import calls, kept_index
    kept, dropped = torch.arange(50, dtype=torch.int32), torch.arange(60, dtype=torch.int32)
    calls.per_layout("doubled", kept, lambda x: x * 2, kept)
    calls.per_layout("doubled", dropped, lambda x: x * 2, dropped)
    rewritten([kept, dropped])
    kept_index.start_check(kept)
    gone = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert gone() is None
    generation = kept_index._GENERATIONS.get(kept)
    assert kept_index.current(kept) is generation and generation.stamp == kept_index.stamp_of(kept)


def test_a_2_4_forward_starts_the_check_its_backward_reads(monkeypatch):
    """A 2:4 layer's forward starts the comparison of rewritten metadata, so the backward's
    transposable answer needs no check on the spot (on a GPU: no host sync in the backward)."""
    from sparsegen.semi24 import autograd, format as semi24
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    mask = semi24.transposable_mask(weight)
    values, metadata = semi24.compress(weight * mask, mask)
    assert autograd.stored_transposable(metadata, 32, 64)
    checks = counted_sync_checks(monkeypatch)
    metadata.copy_(metadata.clone())            # DDP's broadcast
    x = torch.randn(3, 64)
    y = autograd.sp24_any_device(x, values, metadata, None, 32)
    assert autograd.stored_transposable(metadata, 32, 64) and checks == []
    torch.testing.assert_close(y, x @ (weight * mask).t())


def test_a_fresh_weights_dense_decision_is_made_once_per_signature_and_forgotten_with_plans(monkeypatch):
    """fresh_takes_dense (a W made in the step: cuBLAS on it expanded, or the kernel) asks the
    crossover table once per signature, only for 16-bit calls worth more than the host's
    share, and again after plans are forgotten (a crossover table reloaded)."""
    from sparsegen.launch import dense_path
    from sparsegen.semi24 import ops
    asked = []
    monkeypatch.setattr(dense_path, "wanted", lambda *args: asked.append(args) or True)
    big, small = (4096, 2048, 5632), (16, 2048, 5632)
    assert ops.fresh_takes_dense(*big, torch.bfloat16, 0) and ops.fresh_takes_dense(*big, torch.bfloat16, 0)
    assert len(asked) == 1 and asked[0] == ("sp24", 0, 5632, 2048, 4096)
    assert not ops.fresh_takes_dense(*small, torch.bfloat16, 0)  # the host's share: the kernel
    assert not ops.fresh_takes_dense(*big, torch.float32, 0) and len(asked) == 2
    plans.forget_all()
    assert ops.fresh_takes_dense(*big, torch.bfloat16, 0) and len(asked) == 3


def test_moved_indices_are_compared_in_as_many_operations_whatever_their_number():
    """Every moved index against its copy at once: the changed ones (any dtype, empty ones
    too) are found, and 60 indices take the operations 6 did, views aside (a DDP step moves
    them all)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from sparsegen.launch import kept_index

    class Counted(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view  # (views launch nothing)
            return func(*args, **(kwargs or {}))

    dtypes = [torch.bool, torch.int16, torch.int32, torch.int64, torch.uint8, torch.int32]
    counts = []
    for number in (6, 60):
        indexes = [torch.randint(0, 2 if dtypes[i % 6] == torch.bool else 100, (i % 7 * 5,)).to(dtypes[i % 6])
                   for i in range(number)]
        pairs = [(t, kept_index.Generation(t.clone(), kept_index.stamp_of(t))) for t in indexes]
        changed = {i for i in range(1, number, 4) if indexes[i].numel()}
        for i in changed:
            indexes[i][-1] = ~indexes[i][-1] if indexes[i].dtype == torch.bool else indexes[i][-1] + 1
        with Counted() as mode:
            differs = kept_index._differing(pairs)
        assert differs == [i in changed for i in range(number)]
        counts.append(mode.ops)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("device", ON_EVERY_DEVICE)
def test_a_rewrite_keeps_what_was_derived_and_a_change_derives_again_on_every_device(device):
    """The same on indices of several dtypes, one of them empty, on the CPU and on CUDA (where
    DDP's broadcast rewrites them)."""
    from sparsegen.launch import calls, kept_index
    indexes = [torch.randint(0, 100, (n,), device=device).to(dtype)
               for n, dtype in [(64, torch.int32), (0, torch.int64), (33, torch.int16), (5, torch.int64)]]
    builds = []
    derive = doubling_counted(builds)

    first = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    rewritten(indexes)
    assert all(calls.per_layout("doubled", t, derive, t) is f for t, f in zip(indexes, first)) and len(builds) == 4
    indexes[2][7] += 1
    rewritten(indexes)
    again = [calls.per_layout("doubled", t, derive, t) for t in indexes]
    assert len(builds) == 5 and torch.equal(again[2], indexes[2] * 2)
    assert all(again[i] is first[i] for i in (0, 1, 3))
    assert kept_index._differing([(t, kept_index.current(t)) for t in indexes]) == [False] * 4


@pytest.mark.parametrize("device", ON_EVERY_DEVICE)
def test_the_compiled_2_4_forward_starts_the_check_its_backward_reads(monkeypatch, device):
    """The same through the launcher a compiled graph calls for the 2:4 forward (Inductor's
    lowering, not the eager op): metadata rewritten as DDP's default does before each forward
    is compared from there, and the backward's transposable answer needs no check on the spot.
    (On the CPU the launcher hands the call to the eager op, which starts it too.)"""
    from sparsegen.semi24 import autograd, compiled
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dense = torch.nn.Linear(128, 64, device=device, dtype=dtype)
    layer = sparsegen.Sparse24Linear.from_dense(dense, method="transposable")
    assert autograd.stored_transposable(layer.metadata, 64, 128)
    checks = counted_sync_checks(monkeypatch)
    rewritten([layer.metadata])
    x = torch.randn(37, 128, device=device, dtype=dtype)
    out = torch.full((37, 64), float("nan"), device=device, dtype=dtype)
    compiled.sp24_dds_into(x, layer.values, layer.metadata, None, 64, "none", out=out)
    assert autograd.stored_transposable(layer.metadata, 64, 128) and checks == []
    torch.testing.assert_close(out.double(), x.double() @ layer.to_dense_weight().double().t(), rtol=2e-2, atol=2e-2)
