"""sparsegen.dense_copy: the dense model a patched one computes, with the model's own modules -
what patch fused put back apart - so that it checks the sparse model and exports where
sparsegen is not installed (its state_dict has the unpatched model's names and shapes)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from .jit import epilogues
from .layer import dense_linear
from .patching import FusedActivation, GatedMLP, _is_sparse_layer, _replace


def dense_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every sparsegen layer replaced by the dense layer of its
    (masked) weight - nn.Linear, or the transformers Conv1D it replaced - and what patch fused
    apart again: a GatedMLP is the model's own MLP class with gate_proj, up_proj and down_proj,
    an activation taken into a layer's epilogue is its module again. So the copy computes what
    the sparse model does, and its state_dict loads into the unpatched model (transformers'
    from_pretrained of its save_pretrained). One-byte layers become their dequantized weight
    in the model's floating dtype."""
    twin = copy.deepcopy(model)
    dtype = _model_dtype(twin)
    for name, module in list(twin.named_modules()):
        if _is_sparse_layer(module):
            _replace(twin, name, _dense_layer(module, dtype))
    for name, module in list(twin.named_modules()):
        if isinstance(module, GatedMLP) and module.replaced is not None:
            _replace(twin, name, _unfused_mlp(module))
        elif isinstance(module, FusedActivation):
            _put_back_activation(twin, name, module)
    return twin


def _dense_layer(layer: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """The layer's to_linear (in the model's dtype for one-byte layers), as the class it replaced."""
    dense = layer.to_linear(dtype) if _keeps_own_dtypes(layer) else layer.to_linear()
    replaced = getattr(layer, "replaced_class", None)
    if replaced is None:
        return dense
    if isinstance(dense, epilogues.DenseEpilogue):
        dense.linear = _as_conv1d(dense.linear, replaced)
        return dense
    return _as_conv1d(dense, replaced)


def _as_conv1d(linear: nn.Linear, conv1d: type) -> nn.Module:
    """transformers' Conv1D(nf, nx) of an nn.Linear: the same product, its weight stored [in, out]."""
    conv = conv1d(linear.out_features, linear.in_features)
    conv.weight = nn.Parameter(linear.weight.detach().t().contiguous())
    conv.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
    return conv.to(linear.weight.device)


def _unfused_mlp(mlp: GatedMLP) -> nn.Module:
    """The MLP a GatedMLP replaced, rebuilt with gate and up split from its dense gate_up."""
    fused = mlp.gate_up.linear if isinstance(mlp.gate_up, epilogues.DenseEpilogue) else mlp.gate_up
    gates, ups = epilogues.split_rows(fused.weight.detach())
    biases = epilogues.split_rows(fused.bias.detach()) if fused.bias is not None else (None, None)
    rebuilt = copy.deepcopy(mlp.replaced)
    if "gate_up_proj" in rebuilt._modules:  # (a fused form: the gate's rows first, then up's)
        bias = None if biases[0] is None else torch.cat(biases)
        rebuilt.gate_up_proj = dense_linear(torch.cat([gates, ups]), bias)
    else:
        rebuilt.gate_proj, rebuilt.up_proj = dense_linear(gates, biases[0]), dense_linear(ups, biases[1])
    rebuilt.down_proj = mlp.down_proj
    return rebuilt


def _put_back_activation(model: nn.Module, name: str, fused: FusedActivation) -> None:
    """The activation module where patch left a FusedActivation, and a plain layer before it."""
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    layer = getattr(parent, fused.linear)
    if isinstance(layer, epilogues.DenseEpilogue):  # (a layer of its own otherwise: keep the Identity)
        setattr(parent, fused.linear, layer.linear)
        setattr(parent, attribute, fused.activation)


def _keeps_own_dtypes(module: nn.Module) -> bool:
    """A layer whose tensors keep their dtypes through a model's casts (one-byte weights and
    float32 scales: its OWN_DTYPES); its to_linear takes the model's dtype."""
    return bool(getattr(module, "OWN_DTYPES", ()))


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The 16- or 32-bit float dtype of the model's first such tensor outside one-byte layers
    (their scales are float32 whatever the model's dtype), or None (the layers' default)."""
    scaled = {id(t) for m in model.modules() if _keeps_own_dtypes(m)
              for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in scaled and tensor.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return tensor.dtype
    return None
