"""Many CUDA graphs, streams and threads on the GPU, as serving stacks and training loops use
them: one graph per batch size replayed in random order, a train step and an eval step
captured from one model and replayed interleaved, two threads on two streams at once - all
against eager results (a graph may take cuBLAS on a dense copy where eager calls take the
kernel: rounding differs, bits stay the same replay after replay). And running out of
memory (pytest -m gpu)."""
import copy
import gc
import random
import threading

import pytest
import torch
from torch import nn

import sparsegen
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.launch import dense_path, workspace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = dict(device="cuda", dtype=torch.bfloat16)
SPARSE = {"2:4": lambda i, o: sparsegen.Sparse24Linear(i, o, **BF16),
          "b32": lambda i, o: sparsegen.linear(i, o, block=(32, 32), density=0.5, **BF16),
          "b64": lambda i, o: sparsegen.linear(i, o, block=(64, 64), density=0.25, **BF16),
          "bell": lambda i, o: BlockEllLinear(i, o, block=(32, 32), density=0.5, **BF16),
          "bdiag": lambda i, o: sparsegen.linear(i, o, sparsity="block-diagonal", nblocks=4, **BF16),
          "fp8-2:4": lambda i, o: sparsegen.ScaledSparse24Linear.from_dense(nn.Linear(i, o, **BF16), "e4m3"),
          "int4-2:4": lambda i, o: sparsegen.Int4Sparse24Linear.from_dense(nn.Linear(i, o, **BF16))}
WIDTH, HIDDEN = 512, 1024
BATCHES = [2 ** i for i in range(9)]  # 1 ... 256 tokens, a graph each


def mlp(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(SPARSE[kind](WIDTH, HIDDEN), nn.GELU(), SPARSE[kind](HIDDEN, WIDTH))


def relative_error(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def captured(fn, *static):
    """(graph, output) of fn(*static) captured after a warm-up on a side stream, as PyTorch's
    CUDA-graph docs do (kernels loaded, plans and dense copies made first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    return graph, out


def replayed(graph, static_in, out, x):
    static_in.copy_(x)
    out.fill_(float("nan"))
    graph.replay()
    return out.clone()


@pytest.mark.parametrize("kind", SPARSE)
@torch.no_grad()
def test_one_graph_per_batch_size_replayed_in_random_order(kind):
    model = mlp(kind)
    graphs = {}
    for tokens in BATCHES:
        static_in = torch.randn(tokens, WIDTH, **BF16)
        graphs[tokens] = (*captured(model, static_in), static_in)
    order = BATCHES * 3
    random.Random(0).shuffle(order)
    for tokens in order:
        graph, out, static_in = graphs[tokens]
        x = torch.randn(tokens, WIDTH, **BF16)
        first, second = replayed(graph, static_in, out, x), replayed(graph, static_in, out, x)
        assert torch.equal(first, second)  # the same bits replay after replay
        assert relative_error(first, model(x)) < 2e-2  # eager: the same up to rounding


@pytest.mark.parametrize("kind", SPARSE)
@torch.no_grad()
def test_reduce_overhead_records_graphs_without_skipping_them(kind):
    """torch.compile(mode="reduce-overhead") over every layer kind: Inductor records CUDA graphs
    (no cudagraph skip: no CPU tensor, no mutated input, no op it cannot capture), replays them
    for fresh inputs, and computes eager mode's outputs up to rounding."""
    from torch._dynamo.utils import counters

    model = mlp(kind)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for tokens in (1, 8, 1, 8, 64):
        x = torch.randn(tokens, WIDTH, **BF16)
        assert relative_error(compiled(x).clone(), model(x)) < 2e-2, tokens
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def train_step(model, optimizer, x, target):
    optimizer.zero_grad(set_to_none=True)
    (model(x).float() - target).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("kind", ["2:4", "b64", "bell", "bdiag"])
def test_train_and_eval_graphs_replayed_interleaved_match_eager(kind):
    """The eval graph is captured first, while the weights are untouched (so it may read a
    dense copy); the train graph's optimizer steps then change the weights under it. An eager
    twin takes the same steps."""
    model = mlp(kind)
    twin = copy.deepcopy(model)
    optimizer, twin_optimizer = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin))
    x_eval, x_train = torch.randn(16, WIDTH, **BF16), torch.randn(64, WIDTH, **BF16)
    target = torch.randn(64, WIDTH, device="cuda")
    with torch.no_grad():
        eval_graph, eval_out = captured(model, x_eval)
    train_graph, _ = captured(lambda: train_step(model, optimizer, x_train, target))
    train_step(twin, twin_optimizer, x_train, target)  # the warm-up's step (the capture takes none)
    steps = ["train"] * 4 + ["eval"] * 4
    random.Random(1).shuffle(steps)
    for step in steps + ["eval"]:
        if step == "train":
            train_graph.replay()
            train_step(twin, twin_optimizer, x_train, target)
            continue
        x = torch.randn_like(x_eval)
        got = replayed(eval_graph, x_eval, eval_out, x)
        with torch.no_grad():
            assert relative_error(got, twin(x)) < 3e-2


@pytest.mark.parametrize("kind", ["2:4", "b32", "bdiag"])
def test_two_threads_on_two_streams_train_and_infer_at_once(kind):
    """One thread runs forward + backward of one model, another inference of a second, each on
    its own stream, many times; each matches the same work done alone."""
    models = [mlp(kind), mlp(kind)]
    inputs = [torch.randn(96, WIDTH, **BF16, requires_grad=True), torch.randn(5, WIDTH, **BF16)]
    alone = [work(models[0], inputs[0], True), work(models[1], inputs[1], False)]
    results, errors = [None, None], []

    def run(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                results[i] = [work(models[i], inputs[i], i == 0) for _ in range(20)]
            stream.synchronize()
        except Exception as error:  # (reported by the test, not lost in the thread)
            errors.append(error)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for i in range(2):
        for got in results[i]:
            assert all(torch.equal(a, b) for a, b in zip(got, alone[i]))


def work(model, x, backward: bool) -> list[torch.Tensor]:
    """Y (and with `backward` dX and the first layer's values grad) of model(x)."""
    if not backward:
        with torch.no_grad():
            return [model(x)]
    x.grad = None
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.float().square().sum().backward()
    return [y.detach(), x.grad.clone(), model[0].values.grad.clone()]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["2:4", "b32"])
@torch.no_grad()
def test_the_same_layer_type_on_two_devices(kind):
    """A layer on each GPU, called in turn: plans, workspaces and kernels are per device."""
    layers = [SPARSE[kind](WIDTH, HIDDEN).to(f"cuda:{d}") for d in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(16, WIDTH, **BF16)
    for _ in range(3):
        ys = [layers[d](x.to(f"cuda:{d}")) for d in range(2)]
        assert torch.equal(ys[0].cpu(), ys[1].cpu())


def fill_memory_leaving(spare_bytes: int) -> list[torch.Tensor]:
    """Tensors that take this process's whole allowance but for one cached free block of
    `spare_bytes` (and less than 2 MiB elsewhere); a small tensor made and freed first leaves
    room for small allocations."""
    torch.empty(1024, device="cuda")  # (freed at once: its 2 MiB segment stays cached)
    spare, blockers, chunk = torch.empty(spare_bytes, dtype=torch.uint8, device="cuda"), [], 256 << 20
    while chunk >= 2 << 20:
        try:
            blockers.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            chunk //= 2
    del spare
    return blockers


@pytest.fixture
def memory_cap():
    """This process may use 4 GiB of the GPU beyond what it holds already (earlier tests'
    compiled models and graph pools stay alive in Dynamo's caches: ~4 GiB on an H200)."""
    gc.collect()
    torch.cuda.empty_cache()
    fraction = (torch.cuda.memory_reserved() + (4 << 30)) / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction)
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def dense_reference(layer, x):
    return x.double() @ layer.to_dense_weight().double().t() + layer.bias.double()


@torch.no_grad()
def test_dense_copy_out_of_memory_names_it_and_the_layer_works_after(memory_cap, dense_everywhere):
    """The crossover table sends the call to cuBLAS, whose dense copy (32 MiB) cannot be made."""
    layer = sparsegen.linear(4096, 4096, block=(64, 64), density=0.5, **BF16)  # (the table's density)
    x = torch.randn(8, 4096, **BF16)
    blockers = fill_memory_leaving(4 << 20)
    with pytest.raises(torch.OutOfMemoryError, match="dense copy of a sparse weight"):
        layer(x)
    assert layer.row_offsets not in dense_path._COPIES  # nothing half-made kept
    del blockers
    y = layer(x)
    assert dense_path._COPIES[layer.row_offsets].weight.shape == (4096, 4096)
    assert relative_error(y, dense_reference(layer, x)) < 1e-2


@torch.no_grad()
def test_split_k_workspace_out_of_memory_names_it_and_the_call_works_after(memory_cap, monkeypatch):
    """Y (4 MiB) fits in the spare block, the split-K workspace (8 MiB) does not."""
    from sparsegen.semi24 import ops as sp24_ops
    monkeypatch.setenv("SPARSEGEN_DENSE_FALLBACK", "0")  # (some GPUs' tables send this shape to cuBLAS)
    monkeypatch.setattr(workspace, "_WORKSPACES", {})
    layer = sparsegen.Sparse24Linear(8192, 8192, **BF16)
    x = torch.randn(256, 8192, **BF16)

    def product():
        return sp24_ops.sp24_dds(x, layer.values, layer.metadata, layer.bias, 8192, splits=4)
    blockers = fill_memory_leaving(6 << 20)
    with pytest.raises(torch.OutOfMemoryError, match="split-K workspace"):
        product()
    assert not any(workspace._WORKSPACES.values())
    del blockers
    assert relative_error(product(), dense_reference(layer, x)) < 1e-2
