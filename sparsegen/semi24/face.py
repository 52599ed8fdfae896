"""How users ask for 2:4 layers: sparsegen.linear(sparsity="2:4") gives a Sparse24Linear; with
2by4-pretrain options a Sparse24TrainingLinear; with weight_dtype "e4m3" or "int8" a
ScaledSparse24Linear, with "int4" an Int4Sparse24Linear (group_size: its scales' columns; given
alone it means weight_dtype="int4", the one grouped quantization) (registry.Face)."""
from __future__ import annotations

import torch

from ..errors import expect
from ..jit import registry
from ..launch import runtime
from . import int4, tensor
from .dispatch import DTYPE_NAMES
from .ops import has_byte_kernels
from .specs import SCALED_CODES, sp24_compress_spec, sp24_quantize_spec
from .nn import Sparse24Linear
from .int4_nn import Int4Sparse24Linear
from .scaled import WEIGHT_DTYPES, ScaledSparse24Linear
from .train import Sparse24TrainingLinear

TRAINING_OPTIONS = ("method", "mask_interval", "dw_sparse", "soft_threshold")


def build(in_features, out_features, bias, device, dtype, given):
    recipe = {name: given[name] for name in TRAINING_OPTIONS if name in given}
    given = _with_group_size(given)
    if "weight_dtype" in given:
        expect(not recipe, "no training options for quantized weights (an inference layer)", sorted(recipe))
        dense = torch.nn.Linear(in_features, out_features, bias, device, dtype)
        return _quantized(dense, given, "magnitude")
    if recipe:
        return Sparse24TrainingLinear(in_features, out_features, bias, device, dtype, **recipe)
    return Sparse24Linear(in_features, out_features, bias, device, dtype)


def patched(linear, settings: dict, from_dense: bool):
    """A patch rule's layer, always pruned from the linear's weight: the 2by4 recipe's with
    "training", a one-byte one with "weight_dtype", else a Sparse24Linear by "method"."""
    if "training" in settings:  # 2by4-pretrain style: dense weights, 2:4 products
        return Sparse24TrainingLinear.from_dense(linear, **dict(settings["training"]))
    settings = _with_group_size(settings)
    if "weight_dtype" in settings:  # quantized weights: one-byte (activations too, scaled) or 4-bit
        return _quantized(linear, settings, settings.get("method", "magnitude"))
    return Sparse24Linear.from_dense(linear, settings.get("method", "magnitude"))


def packing(settings: dict, weight: torch.Tensor) -> list:
    """The kernels patched() launches on `weight`: the compressing one (tensor.prune_and_compress),
    the transposable mask's where the rule's method is "transposable", and for one-byte weights
    the quantizing one (scaled.quantized_rows)."""
    if _with_group_size(settings).get("weight_dtype") == "int4":  # (from_dense prunes it in its scale dtype)
        weight = weight.new_empty(0, dtype=int4.scale_dtype_for(weight.dtype))
    if not tensor.on_kernels(weight):
        return []
    training = settings.get("training")
    method = settings.get("method", "magnitude") if training is None else training.get("method", "transposable")
    ops = ("sp24_compress", "sp24_mask") if method == "transposable" else ("sp24_compress",)
    arch = runtime.device_arch(weight.device)
    specs = [sp24_compress_spec(DTYPE_NAMES[weight.dtype], arch, op) for op in ops]
    byte = WEIGHT_DTYPES.get(settings.get("weight_dtype"))
    if byte is not None and has_byte_kernels(byte, weight.device):  # (scaled.quantized_rows)
        specs.append(sp24_quantize_spec(DTYPE_NAMES[byte], arch, SCALED_CODES[weight.dtype]))
    return specs


def _quantized(linear, given: dict, method: str):
    if given["weight_dtype"] == "int4":
        return Int4Sparse24Linear.from_dense(linear, given.get("group_size", 128), method)
    return ScaledSparse24Linear.from_dense(linear, given["weight_dtype"], method)


def _with_group_size(given: dict) -> dict:
    """given, group_size's weight_dtype "int4" filled in (it is for no other weight dtype)."""
    if "group_size" not in given:
        return given
    expect(given.get("weight_dtype", "int4") == "int4", "group_size only with weight_dtype='int4' (its scales' "
           "columns)", repr(given.get("weight_dtype")))
    return {"weight_dtype": "int4", **given}


def check_rule(pattern: str, settings: dict) -> None:
    _with_group_size(settings)
    expect("weight_dtype" not in settings or "training" not in settings,
           f"weight_dtype or training for {pattern!r}, not both (one-byte layers are for inference)", settings)
    training = settings.get("training", {})
    options = ("mask_interval", "method", "dw_sparse", "soft_threshold")
    expect(isinstance(training, dict) and set(training) <= set(options),
           f"'training' settings for {pattern!r} as a dict with keys from {options}", training)


FACES = (registry.Face("2:4", ("weight_dtype", "group_size", *TRAINING_OPTIONS), build,
                       rule=("method", "training", "weight_dtype", "group_size"),
                       patch=patched, check_rule=check_rule, pairs=lambda settings: "training" not in settings,
                       packing=packing,
                       examples=(("weight_dtype", "int8", lambda layer: layer.values.dtype == torch.int8),
                                 ("group_size", -1, lambda layer: layer.qweight.dtype == torch.int32
                                  and tuple(layer.scales.shape) == (1, layer.out_features)),
                                 ("method", "magnitude", lambda layer: layer.method == "magnitude"),
                                 ("mask_interval", 7, lambda layer: layer.mask_interval == 7),
                                 ("dw_sparse", True, lambda layer: layer.dw_sparse),
                                 ("soft_threshold", True, lambda layer: layer.soft_threshold)),
                       tuning=registry.Tuning("sp24", (((0, 0), 1.0),),
                                              lambda n, k, block, density, **factory: Sparse24Linear(k, n, **factory),
                                              fits=lambda n, k, block, density: True)),)
