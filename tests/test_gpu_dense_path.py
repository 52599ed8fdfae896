"""The dense path on the GPU: where this GPU's table says a sparse kernel loses, a layer runs
cuBLAS on a dense copy of its weight - right against float64, dropped once trained, and
inside CUDA graphs (pytest -m gpu)."""
import pytest
import torch

import sparsegen
from sparsegen.bell.nn import BlockEllLinear
from sparsegen.launch import calls, crossovers, dense_path, runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


LAYERS = {"2:4": lambda: sparsegen.Sparse24Linear(320, 192, device="cuda", dtype=torch.bfloat16),
          "b32": lambda: sparsegen.linear(320, 192, block=(32, 32), density=0.5, device="cuda", dtype=torch.bfloat16),
          "bell": lambda: BlockEllLinear(320, 192, block=(32, 32), density=0.5, device="cuda", dtype=torch.bfloat16),
          "bdiag": lambda: sparsegen.linear(320, 192, sparsity="block-diagonal", nblocks=2, device="cuda",
                                            dtype=torch.bfloat16)}


def copy_key(layer):
    """The tensor a layer's dense copy is kept under (its index, else its values)."""
    for name in ("metadata", "row_offsets", "cols", "values"):
        if hasattr(layer, name):
            return getattr(layer, name)


def reference(layer, x):
    return x.double() @ layer.to_dense_weight().double().t() + layer.bias.double()


def relative_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", LAYERS)
def test_losing_layer_runs_cublas_on_a_dense_copy(dense_everywhere, kind):
    layer = LAYERS[kind]()
    for rows in (7, 300):
        x = torch.randn(3, rows, 320, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            y = layer(x)
        assert relative_error(y, reference(layer, x)) < 1e-2
    key = copy_key(layer)
    assert dense_path._COPIES[key].weight.shape == (192, 320)  # one copy, whatever the token count


@pytest.mark.parametrize("kind", LAYERS)
def test_trained_layer_drops_its_copy_and_stays_right(dense_everywhere, kind):
    layer = LAYERS[kind]()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(dense_path.TRAINED_AFTER + 2):
        x = torch.randn(64, 320, device="cuda", dtype=torch.bfloat16)
        y = layer(x)
        assert relative_error(y.detach(), reference(layer, x)) < 1e-2
        y.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    key = copy_key(layer)
    assert dense_path._COPIES[key].weight is None


@pytest.mark.parametrize("kind", LAYERS)
def test_dense_path_inside_a_cuda_graph(dense_everywhere, kind, graph_replay):
    layer = LAYERS[kind]()
    x = torch.randn(48, 320, device="cuda", dtype=torch.bfloat16)
    y = graph_replay(layer, x)  # (its warm-up call makes the copy outside the graph)
    assert relative_error(y, reference(layer, x)) < 1e-2


@pytest.mark.parametrize("kind", LAYERS)
def test_host_bound_eager_call_keeps_its_kernels_and_its_graph_takes_the_copy(losing_table, kind, monkeypatch):
    """A small call outside graphs launches its kernel (less host time than cuBLAS's path) but
    builds the copy, which the CUDA graph captured next runs."""
    dense_calls = []
    real = calls.dense_result
    monkeypatch.setattr(calls, "dense_result", lambda *args: dense_calls.append(1) or real(*args))
    layer = LAYERS[kind]()
    x = torch.randn(48, 320, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        assert not dense_calls and relative_error(eager, reference(layer, x)) < 1e-2
        assert dense_path._COPIES[copy_key(layer)].weight is not None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
    assert dense_calls
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    assert relative_error(y, reference(layer, x)) < 1e-2


@pytest.mark.parametrize("kind", ["bell", "bdiag"])
def test_kit_layout_without_a_losing_point_keeps_its_kernels(winning_table, kind):
    layer = LAYERS[kind]()
    x = torch.randn(48, 320, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
    assert relative_error(y, reference(layer, x)) < 1e-2
    assert copy_key(layer) not in dense_path._COPIES


def test_tune_measures_one_layout_and_keeps_the_others_points(losing_table, tmp_path):
    from sparsegen import tune
    before = crossovers.table(runtime.device_name(0))
    out = tune.run(shapes=[(768, 768)], tokens=[16], layouts=[("bdiag", (0, 0), 0.5)], out=tmp_path / "t.json",
                   log=lambda line: None)
    points = crossovers.load(out)
    assert [p for p in points if p.layout != "bdiag"] == [p for p in before if p.layout != "bdiag"]
    new = [p for p in points if p.layout == "bdiag"]
    assert len(new) == 1 and new[0].block == (64, 64) and new[0].density == 0.5 and new[0].speedup > 0
