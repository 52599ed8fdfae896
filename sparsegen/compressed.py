"""load_compressed: 2:4 checkpoints in the compressed-tensors format (what llm-compressor
saves) into sparsegen layers.

A checkpoint directory holds config.json, whose quantization_config names the formats, and
*.safetensors files (read without unpickling). A 2:4 layer `<name>` is stored as
`<name>.shape` ([2, 1]: out, in), `<name>.compressed` ([out, in/2], the kept values of each
group of 4 in column order) and `<name>.bitmask` (uint8 [out, ceil(in/8)], the kept
positions, bit j of byte b for column 8b + j); FP8 and int8 layers add `<name>.weight_scale`
([out, 1], per output channel) and, for static activation scales, `<name>.input_scale`.
Every tensor is checked before anything in the model changes.
"""
from __future__ import annotations

import json
import pathlib

import torch
from torch import nn

from . import patching
from .errors import InputError, expect
from .semi24 import format as semi24
from .semi24.nn import Sparse24Linear
from .semi24.scaled import ScaledSparse24Linear

SPARSE_FORMAT = "sparse-24-bitmask"
_QUANTIZED_FORMATS = {"float-quantized": torch.float8_e4m3fn, "int-quantized": torch.int8,
                      "naive-quantized": None}
_PARTS = ("shape", "compressed", "bitmask")


def load_compressed(model: nn.Module, path, fuse: bool = True) -> list[str]:
    """Load the compressed-tensors checkpoint at `path` (a directory) into `model`, a model
    built from the same config: each 2:4 layer becomes a Sparse24Linear (16-bit weights) or
    a ScaledSparse24Linear (FP8 / int8 weights, per-channel scales), every other tensor is
    loaded as it is. With `fuse`, gated MLPs then run gate and up as one layer with the gated
    epilogue, as sparsegen.patch builds them (patching.fuse_loaded_gated_mlps: their names
    become <mlp>.gate_up). Returns the names of the 2:4 layers in the file."""
    expect(isinstance(model, nn.Module), "a torch.nn.Module built from the checkpoint's config",
           type(model).__name__)
    folder = pathlib.Path(path)
    device = _device_of(model)
    config = _quantization_config(folder)
    tensors = _read_tensors(folder)
    names = sorted({key.rsplit(".", 1)[0] for key in tensors if key.endswith(".bitmask")})
    layers = {name: _layer(model, name, tensors, config) for name in names}
    rest = {key: value for key, value in tensors.items() if key.rsplit(".", 1)[0] not in layers}
    _check_rest(model, rest)
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.to(device))
    model.load_state_dict(rest, strict=False)
    if fuse:
        patching.fuse_loaded_gated_mlps(model)
    return names


def _quantization_config(folder: pathlib.Path) -> dict:
    expect(folder.is_dir() and (folder / "config.json").is_file(),
           "a checkpoint directory with config.json", str(folder))
    config = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    expect(config.get("quant_method") == "compressed-tensors", "quantization_config.quant_method "
           "'compressed-tensors' in config.json", repr(config.get("quant_method")))
    sparse = (config.get("sparsity_config") or {}).get("format")
    expect(sparse == SPARSE_FORMAT, f"sparsity_config.format {SPARSE_FORMAT!r} (2:4 checkpoints)", repr(sparse))
    quantized = config.get("format", "dense")
    expect(quantized == "dense" or quantized in _QUANTIZED_FORMATS,
           f"quantization_config.format 'dense' or one of {sorted(_QUANTIZED_FORMATS)}", repr(quantized))
    return config


def _read_tensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise InputError("Expected the safetensors package (pip install safetensors) to read checkpoints. "
                         "Got none.") from None
    files = sorted(folder.glob("*.safetensors"))
    expect(files, "*.safetensors files in the checkpoint directory", str(folder))
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _device_of(model: nn.Module) -> torch.device:
    """The model's device; a model on the meta device is refused (the layers built here would
    be moved there and lose the checkpoint's values)."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    expect(device.type != "meta", "a model with its tensors allocated (on the CPU or a GPU)", "the meta device")
    return device


def _layer(model: nn.Module, name: str, tensors: dict, config: dict) -> nn.Module:
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise InputError(f"Expected {name!r}, a 2:4 layer of the checkpoint, in the model. "
                         "Got no such module.") from None
    expect(isinstance(linear, nn.Linear), f"{name} to be an nn.Linear in the model", type(linear).__name__)
    try:
        dense, mask = _unpacked(name, tensors, tuple(linear.weight.shape))
        bias = tensors.get(f"{name}.bias", linear.bias)
        if f"{name}.weight_scale" not in tensors:
            return _sixteen_bit(linear, dense, mask, bias)
        return _scaled(name, dense, mask, bias, tensors, config, linear.weight.dtype)
    except InputError as error:
        raise InputError(f"{name}: {error}") from None


def _unpacked(name: str, tensors: dict, want: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dense weight, its 2:4 mask) from shape / compressed / bitmask, checked."""
    missing = [part for part in _PARTS if f"{name}.{part}" not in tensors]
    expect(not missing, f"{name}.shape, .compressed and .bitmask", f"none for {missing}")
    shape, values, bits = (tensors[f"{name}.{part}"] for part in _PARTS)
    expect(shape.numel() == 2 and not shape.is_floating_point() and tuple(shape.flatten().tolist()) == want,
           f"shape {list(want)} (the model's layer)", shape.flatten().tolist())
    n, k = want
    expect(k % 4 == 0, "in_features a multiple of 4 (2:4 groups)", k)
    expect(tuple(values.shape) == (n, k // 2), f"compressed values of shape {(n, k // 2)}", tuple(values.shape))
    expect(bits.dtype == torch.uint8 and tuple(bits.shape) == (n, -(-k // 8)),
           f"a uint8 bitmask of shape {(n, -(-k // 8))}", f"{bits.dtype} {tuple(bits.shape)}")
    mask = unpack_bitmask(bits, k)
    _check_pairs(mask)
    return semi24.scatter_kept(values, mask), mask


def _check_pairs(mask: torch.Tensor) -> None:
    """Exactly 2 kept of every 4 columns (the compressed values hold in/2 per row); the
    error names the first group that is not."""
    kept = mask.reshape(mask.shape[0], -1, 4).sum(-1)
    bad = (kept != 2).nonzero()
    if bad.numel():
        row, group = (int(i) for i in bad[0])
        expect(False, "a bitmask with 2 kept in every group of 4 columns",
               f"{int(kept[row, group])} kept at row {row}, columns {4 * group}..{4 * group + 3}")


def unpack_bitmask(bits: torch.Tensor, columns: int) -> torch.Tensor:
    """bool [rows, columns]: bit j of byte b is column 8b + j (numpy's little bit order)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.reshape(bits.shape[0], -1)[:, :columns].bool()


def _sixteen_bit(linear: nn.Linear, dense: torch.Tensor, mask: torch.Tensor, bias) -> Sparse24Linear:
    semi24.check_dtype(dense.dtype)
    twin = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device="meta")
    twin.weight = nn.Parameter(dense)
    twin.bias = None if bias is None else nn.Parameter(bias.detach().to(dense.dtype))
    return Sparse24Linear.from_dense(twin, mask=mask)


def _scaled(name: str, dense: torch.Tensor, mask: torch.Tensor, bias, tensors: dict, config: dict,
            activations: torch.dtype) -> ScaledSparse24Linear:
    want = _QUANTIZED_FORMATS.get(config.get("format"))
    expect(dense.dtype in (torch.float8_e4m3fn, torch.int8) and dense.dtype == (want or dense.dtype),
           f"one-byte values of the checkpoint's format {config.get('format')!r}", dense.dtype)
    values, metadata = semi24.compress(dense.contiguous(), mask.contiguous())
    scale = tensors[f"{name}.weight_scale"].float().reshape(-1)
    input_scale = tensors.get(f"{name}.input_scale")
    expect(input_scale is None or input_scale.numel() == 1, "one input_scale per layer (per-tensor)",
           tuple(input_scale.shape) if input_scale is not None else None)
    bias = None if bias is None else bias.detach().to(activations)
    return ScaledSparse24Linear(values, metadata, scale, bias, input_scale)


def _check_rest(model: nn.Module, rest: dict) -> None:
    """The checkpoint's other tensors name the model's own, of the model's shapes."""
    own = model.state_dict()
    for key, value in rest.items():
        expect(key in own, f"{key!r}, a tensor of the checkpoint, in the model", "no such entry")
        expect(tuple(value.shape) == tuple(own[key].shape), f"{key} of shape {tuple(own[key].shape)}",
               tuple(value.shape))
