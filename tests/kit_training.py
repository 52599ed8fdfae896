"""What the training tests share: the kit layouts' compiled gradients, a CUDA graph of a step."""
import torch


def eager_and_compiled_grads(layer, x) -> list[tuple]:
    """(x's, values' and bias's gradients) of sum(layer(x)^2), eagerly, then through
    torch.compile(fullgraph=True): the kit's training path traced whole."""
    grads = []
    for run in (layer, torch.compile(layer, fullgraph=True)):
        run(x).square().sum().backward()
        grads.append((x.grad.clone(), layer.values.grad.clone(), layer.bias.grad.clone()))
        x.grad = layer.values.grad = layer.bias.grad = None
    return grads


def capture_forward_backward(layer, x, grad_out):
    """One warm-up step on a side stream (kernels compiled and loaded, indexes built), then
    the forward and backward captured into a CUDA graph; returns the graph and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    x.grad, layer.values.grad, layer.bias.grad = None, None, None  # allocated by the captured backward
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
        out.backward(grad_out)
    return graph, out


def fresh_replays(graph, out, layer, x, grad_out, times: int = 2):
    """Replay a captured step `times` times, each on fresh inputs with its outputs (Y and the
    gradients) poisoned first; yields after each replay has run."""
    for _ in range(times):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            grad_out.copy_(torch.randn_like(grad_out))
            for result in (out, x.grad, layer.values.grad, layer.bias.grad):
                result.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield
