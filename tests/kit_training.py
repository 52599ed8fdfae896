"""What the kit layouts' training tests share."""
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
