"""load_compressed: 2:4 checkpoints in the compressed-tensors format (what llm-compressor
saves) into sparsegen layers.

A checkpoint directory holds config.json, whose quantization_config names the formats, and
*.safetensors files (read without unpickling). A 2:4 layer `<name>` is stored as
`<name>.shape` ([2, 1]: out, in), `<name>.compressed` ([out, in/2], the kept values of each
group of 4 in column order) and `<name>.bitmask` (uint8 [out, ceil(in/8)], the kept
positions, bit j of byte b for column 8b + j); FP8 and int8 layers add `<name>.weight_scale`
([out, 1], per output channel) and, for static activation scales, `<name>.input_scale`.
Four-bit layers (format "pack-quantized", W4A16 as llm-compressor writes it with a 2:4 sparsity
config) are stored dense instead: `<name>.weight_packed` (int32 [out, in/8], value + 8 at bits
4i of word i / 8), `<name>.weight_scale` ([out, in / group_size], or [out, 1] per channel) and
`<name>.weight_shape`; their 2:4 structure is that of the values (at most two of every four
non-zero) and becomes an Int4Sparse24Linear. Every tensor is checked before anything in the
model changes.
"""
from __future__ import annotations

from typing import NamedTuple

import pathlib

import torch
from torch import nn

from . import checkpoint_files, patching
from .errors import InputError, expect
from .semi24 import format as semi24
from .semi24 import int4
from .semi24.int4_nn import Int4Sparse24Linear
from .semi24.nn import Sparse24Linear
from .semi24.scaled import ScaledSparse24Linear
from .semi24.tensor import compress_masked

SPARSE_FORMAT = "sparse-24-bitmask"
_QUANTIZED_FORMATS = {"float-quantized": torch.float8_e4m3fn, "int-quantized": torch.int8,
                      "naive-quantized": None, "pack-quantized": None}
_FOUR_BIT = ("weight_shape", "weight_packed", "weight_scale")
_PARTS = ("shape", "compressed", "bitmask")
_ONE_BYTE = (torch.float8_e4m3fn, torch.int8)


class LoadResult(NamedTuple):
    """What load_compressed did: the 2:4 layers' names as the model has them now (after
    fusion: <mlp>.gate_up), and, as load_state_dict reports them, the model's entries the
    checkpoint lacks and the checkpoint's tensors the model has no place for (both empty
    unless strict=False)."""
    layers: list[str]
    missing_keys: list[str]
    unexpected_keys: list[str]


def load_compressed(model: nn.Module, path, fuse: bool = True, strict: bool = True,
                    allow_nonfinite: bool = False, device=None) -> LoadResult:
    """Load the compressed-tensors checkpoint at `path` (a directory) into `model`, a model
    built from the same config: each 2:4 layer becomes a Sparse24Linear (16-bit weights) or
    a ScaledSparse24Linear (FP8 / int8 weights, per-channel scales), every other tensor is
    loaded as it is. With `fuse`, the model is fused as sparsegen.patch fuses (patching.fuse_loaded):
    gated MLPs, gate and up apart or in one projection, run as one layer with the gated
    epilogue (their names become <mlp>.gate_up), and an fc1-style layer takes its activation.

    All or nothing: every tensor is checked (shape, dtype, finite unless `allow_nonfinite`)
    and, with `strict` (the default, as in load_state_dict), every entry of the model's
    state_dict must come from the checkpoint and every tensor of the checkpoint must be used,
    before anything in the model changes; a refusal is an InputError and leaves the model
    as it was. With strict=False what matches is loaded and the rest is reported.

    A model built with its parameters on the meta device (to be sharded once loaded) takes
    the checkpoint's tensors on `device` (default: where its buffers are): the dense model
    is never allocated."""
    expect(isinstance(model, nn.Module), "a torch.nn.Module built from the checkpoint's config",
           type(model).__name__)
    folder = pathlib.Path(path)
    device = _device_of(model, device)
    config = _quantization_config(folder)
    plan = _Plan(model, checkpoint_files.read_tensors(folder), config, allow_nonfinite)
    if strict:
        _refuse_incomplete(plan)
    _refuse_meta_left(model, plan)
    for name, layer in plan.layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.to(device))
    _load_rest(model, plan.rest, device)
    names = sorted(plan.layers)
    if fuse:
        names = _fused_names(names, patching.fuse_loaded(model, plan.layers))
    return LoadResult(names, plan.missing, plan.unexpected)


def _quantization_config(folder: pathlib.Path) -> dict:
    expect(folder.is_dir() and (folder / "config.json").is_file(),
           "a checkpoint directory with config.json", str(folder))
    config = checkpoint_files.read_json(folder / "config.json").get("quantization_config") or {}
    expect(isinstance(config, dict), "quantization_config as a JSON object in config.json", type(config).__name__)
    expect(config.get("quant_method") == "compressed-tensors", "quantization_config.quant_method "
           "'compressed-tensors' in config.json", repr(config.get("quant_method")))
    sparse = config.get("sparsity_config")
    sparse = sparse.get("format") if isinstance(sparse, dict) else None
    expect(sparse == SPARSE_FORMAT, f"sparsity_config.format {SPARSE_FORMAT!r} (2:4 checkpoints)", repr(sparse))
    quantized = config.get("format", "dense")
    expect(quantized != "marlin-24", "a 4-bit 2:4 checkpoint in compressed-tensors' 'pack-quantized' format "
           "(compressed-tensors deprecated 'marlin-24' and reads it back no more: save it again with llm-compressor)",
           repr(quantized))
    expect(quantized == "dense" or quantized in _QUANTIZED_FORMATS,
           f"quantization_config.format 'dense' or one of {sorted(_QUANTIZED_FORMATS)}", repr(quantized))
    return config


class _Plan:
    """The load, decided and checked whole before the model changes: the 2:4 layers built,
    the other tensors by the model's names, and what either side lacks."""

    def __init__(self, model: nn.Module, tensors: dict, config: dict, allow_nonfinite: bool):
        names = sorted({key.rsplit(".", 1)[0] for key in tensors if key.endswith((".bitmask", ".weight_packed"))})
        expect(names, f"2:4 layers (<name>.bitmask tensors, or 4-bit <name>.weight_packed ones) in a checkpoint whose "
               f"config says {SPARSE_FORMAT!r}", "none")
        used: set[str] = set()
        self.layers = {name: _layer(model, name, tensors, config, used, allow_nonfinite) for name in names}
        own = model.state_dict()
        under_layers = tuple(name + "." for name in names)
        self.rest = {key: value for key, value in tensors.items()
                     if key not in used and key in own and not key.startswith(under_layers)}
        for key, value in self.rest.items():
            _check_entry(key, value, own[key], allow_nonfinite)
        self.unexpected = sorted(set(tensors) - used - set(self.rest))
        covered = set(self.rest) | (used & set(own)) | {f"{name}.weight" for name in names}
        self.missing = _missing(model, own, covered)


def _refuse_incomplete(plan: _Plan) -> None:
    expect(not plan.missing, "every entry of the model's state_dict in the checkpoint (strict=False loads "
           "the rest and returns what is missing)", f"none for {_listed(plan.missing)}")
    expect(not plan.unexpected, "every tensor of the checkpoint to be one of the model's (strict=False "
           "leaves them out and returns them)", f"no place for {_listed(plan.unexpected)}")


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _missing(model: nn.Module, own: dict, covered: set) -> list[str]:
    """The model's entries nothing covers; tied tensors (one parameter under two names, as
    lm_head and embed_tokens often are) are covered by either name. Ties are told by the
    module's own tensors (state_dict's are detached copies; on the meta device every
    tensor has the address 0)."""
    names_by_tensor: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names_by_tensor.setdefault(id(tensor), []).append(name)
    tied = {name: names for names in names_by_tensor.values() for name in names}
    return sorted(key for key in own if not covered.intersection(tied.get(key, [key])))


def _fused_names(names: list[str], fused: dict[str, list[str]]) -> list[str]:
    """The layer names after fusion: a fused MLP's gate and up are its gate_up."""
    renamed = {part: gate_up for gate_up, parts in fused.items() for part in parts}
    return sorted({renamed.get(name, name) for name in names})


def _device_of(model: nn.Module, device) -> torch.device:
    """Where the loaded tensors go: `device`, else the device of the model's allocated
    tensors. A model whose parameters are on the meta device (built without memory, as
    accelerate's init_empty_weights does, to shard it once loaded) needs one of the two: its
    tensors are then the checkpoint's, put there, and the dense model is never allocated."""
    real = [t.device for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"]
    if device is not None:
        device = torch.device(device)
        expect(all(d == device for d in real),
               f"device= where the model's allocated tensors are ({real[0] if real else None})", str(device))
        return device
    expect(real or next(model.parameters(), None) is None, "a model with its tensors allocated (on the CPU or a "
           "GPU), or device= for one on the meta device", "the meta device and no device=")
    return real[0] if real else torch.device("cpu")


def _refuse_meta_left(model: nn.Module, plan: "_Plan") -> None:
    """A tensor on the meta device that nothing in the checkpoint replaces (a buffer that is
    not saved, such as rotary frequencies) would stay without values: refused by name."""
    replaced = tuple(name + "." for name in plan.layers)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta" and name not in plan.rest and not name.startswith(replaced)]
    expect(not left, "every tensor of a model on the meta device to come from the checkpoint (build the "
           "model's buffers on the device: accelerate's init_empty_weights() leaves them there)",
           f"none for {_listed(left)}")


def _load_rest(model: nn.Module, rest: dict, device: torch.device) -> None:
    """The checkpoint's other tensors into the model: copied into allocated ones, put in place
    of meta ones (on `device`, in the model's dtype)."""
    own = dict([*model.named_parameters(), *model.named_buffers()])
    meta = {key for key in rest if key in own and own[key].device.type == "meta"}
    if meta:
        model.load_state_dict({key: rest[key].to(device, own[key].dtype) for key in meta}, strict=False, assign=True)
    model.load_state_dict({key: value for key, value in rest.items() if key not in meta}, strict=False)


def _layer(model: nn.Module, name: str, tensors: dict, config: dict, used: set, allow_nonfinite: bool) -> nn.Module:
    """The sparsegen layer of the checkpoint's 2:4 layer `name`, its tensors checked and added to `used`."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise InputError(f"Expected {name!r}, a 2:4 layer of the checkpoint, in the model. "
                         "Got no such module.") from None
    expect(isinstance(linear, nn.Linear), f"{name} to be an nn.Linear in the model", type(linear).__name__)
    try:
        if f"{name}.weight_packed" in tensors:
            return _four_bit(name, linear, tensors, config, used, allow_nonfinite)
        dense, mask = _unpacked(name, tensors, tuple(linear.weight.shape), allow_nonfinite)
        used.update(f"{name}.{part}" for part in _PARTS)
        bias = _bias(name, tensors, linear, used, allow_nonfinite)
        if dense.dtype not in _ONE_BYTE:
            return _sixteen_bit(linear, dense, mask, bias)
        return _scaled(name, dense, mask, bias, tensors, config, linear.weight.dtype, used, allow_nonfinite)
    except InputError as error:
        raise InputError(f"{name}: {error}") from None


def _bias(name: str, tensors: dict, linear: nn.Linear, used: set, allow_nonfinite: bool):
    """The checkpoint's bias where the model's layer has one (its own where the file lacks
    it: reported missing); a bias for a layer without one is left unused (unexpected)."""
    if linear.bias is None or f"{name}.bias" not in tensors:
        return linear.bias
    bias = tensors[f"{name}.bias"]
    # (16 or 32 bits: a one-byte bias would be cast silently, where a one-byte norm weight is refused)
    expect(bias.is_floating_point() and bias.element_size() > 1 and tuple(bias.shape) == (linear.out_features,),
           f"a floating bias of 16 or 32 bits and shape {(linear.out_features,)}", f"{bias.dtype} {tuple(bias.shape)}")
    _check_finite("bias", bias, allow_nonfinite)
    used.add(f"{name}.bias")
    return bias


def _check_finite(what: str, tensor: torch.Tensor, allow_nonfinite: bool) -> None:
    """No NaN or infinity in a floating tensor (one-byte floats are widened to look)."""
    if allow_nonfinite or not tensor.is_floating_point():
        return
    wide = tensor.float() if tensor.element_size() == 1 else tensor
    bad = int((~torch.isfinite(wide)).sum())
    expect(bad == 0, f"finite values in {what} (allow_nonfinite=True loads them)", f"{bad} NaN or infinite")


def _unpacked(name: str, tensors: dict, want: tuple[int, int],
              allow_nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dense weight, its 2:4 mask) from shape / compressed / bitmask, checked."""
    missing = [part for part in _PARTS if f"{name}.{part}" not in tensors]
    expect(not missing, f"{name}.shape, .compressed and .bitmask", f"none for {missing}")
    shape, values, bits = (tensors[f"{name}.{part}"] for part in _PARTS)
    expect(shape.numel() == 2 and not shape.is_floating_point() and tuple(shape.flatten().tolist()) == want,
           f"shape {list(want)} (the model's layer)", shape.flatten().tolist())
    n, k = want
    expect(k % 4 == 0, "in_features a multiple of 4 (2:4 groups)", k)
    expect(tuple(values.shape) == (n, k // 2), f"compressed values of shape {(n, k // 2)}", tuple(values.shape))
    _check_finite("the compressed values", values, allow_nonfinite)
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
    expect(dense.dtype == linear.weight.dtype, f"compressed values of dtype {linear.weight.dtype} (the model's "
           "layer: build the model in the checkpoint's dtype)", dense.dtype)
    semi24.check_dtype(dense.dtype)
    twin = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device="meta")
    twin.weight = nn.Parameter(dense)
    twin.bias = None if bias is None else nn.Parameter(bias.detach().to(dense.dtype))
    return Sparse24Linear.from_dense(twin, mask=mask)


def _scaled(name: str, dense: torch.Tensor, mask: torch.Tensor, bias, tensors: dict, config: dict,
            activations: torch.dtype, used: set, allow_nonfinite: bool) -> ScaledSparse24Linear:
    want = _QUANTIZED_FORMATS.get(config.get("format"))
    expect(dense.dtype == (want or dense.dtype) and config.get("format", "dense") != "dense",
           f"one-byte values of the checkpoint's quantization format {config.get('format', 'dense')!r}", dense.dtype)
    scale = _scale(name, "weight_scale", tensors, dense.shape[0], used, allow_nonfinite, required=True)
    input_scale = _scale(name, "input_scale", tensors, 1, used, allow_nonfinite, required=False)
    values, metadata = compress_masked(dense, mask)  # (the mask was checked: _check_pairs)
    bias = None if bias is None else bias.detach().to(activations)
    return ScaledSparse24Linear(values, metadata, scale.float().reshape(-1), bias, input_scale)


def _scale(name: str, part: str, tensors: dict, count: int, used: set, allow_nonfinite: bool, required: bool):
    """A one-byte layer's weight_scale ([out, 1] or [out]) or input_scale (one), checked."""
    scale = tensors.get(f"{name}.{part}")
    if scale is None:
        expect(not required, f"{name}.{part} (one-byte values are stored with their scales)", "none")
        return None
    expect(scale.is_floating_point() and scale.numel() == count and scale.dim() <= 2
           and (scale.dim() == 0 or scale.shape[0] == count), f"{part} of {count} floats",
           f"{scale.dtype} {tuple(scale.shape)}")
    _check_finite(part, scale, allow_nonfinite)  # (0 or below: ScaledSparse24Linear refuses it, on every path)
    used.add(f"{name}.{part}")
    return scale


def _four_bit(name: str, linear: nn.Linear, tensors: dict, config: dict, used: set,
              allow_nonfinite: bool) -> Int4Sparse24Linear:
    """An Int4Sparse24Linear of a "pack-quantized" layer: its 4-bit values 2:4 as stored, its
    scales in the model's 16-bit dtype."""
    n, k = linear.out_features, linear.in_features
    group = _int4_group(config, k)
    missing = [part for part in _FOUR_BIT if f"{name}.{part}" not in tensors]
    expect(not missing, f"{name}.weight_shape, .weight_packed and .weight_scale", f"none for {missing}")
    shape, packed, scales = (tensors[f"{name}.{part}"] for part in _FOUR_BIT)
    expect(shape.numel() == 2 and not shape.is_floating_point() and tuple(shape.flatten().tolist()) == (n, k),
           f"weight_shape {[n, k]} (the model's layer)", shape.flatten().tolist())
    expect(packed.dtype == torch.int32 and tuple(packed.shape) == (n, -(-k // 8)),
           f"weight_packed int32 of shape {(n, -(-k // 8))}", f"{packed.dtype} {tuple(packed.shape)}")
    expect(scales.is_floating_point() and tuple(scales.shape) == (n, int4.groups(k, group)),
           f"weight_scale of shape {(n, int4.groups(k, group))}", f"{scales.dtype} {tuple(scales.shape)}")
    _check_finite("weight_scale", scales, allow_nonfinite)
    q = unpack_int4(packed, k)
    mask = _kept_of_four_bit(q)
    values, metadata = compress_masked(q, mask)
    used.update(f"{name}.{part}" for part in _FOUR_BIT)
    dtype = linear.weight.dtype if linear.weight.dtype in int4.SCALE_DTYPES else torch.bfloat16
    bias = _bias(name, tensors, linear, used, allow_nonfinite)
    return Int4Sparse24Linear(int4.pack((values + int4.OFFSET).to(torch.uint8)), metadata,
                              scales.t().to(dtype).contiguous(), None if bias is None else bias.detach(),
                              None if group == k else group)


def _int4_group(config: dict, in_features: int) -> int:
    """The columns of a scale, from the checkpoint's one weight scheme of 4 bits: symmetric
    integers, per group (a multiple of 128: the kernel's stage) or per channel, columns in order."""
    schemes = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()
               if isinstance(group, dict)]
    kinds = {(w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"), w.get("group_size"),
              w.get("actorder")) for w in schemes if isinstance(w, dict)}
    expect(len(kinds) == 1, "one weight scheme in quantization_config.config_groups", sorted(map(str, kinds)))
    bits, kind, symmetric, strategy, group, order = kinds.pop()
    expect(bits == 4 and kind == "int" and symmetric is True and order is None,
           "4-bit symmetric integer weights, columns in order (no actorder), for pack-quantized 2:4",
           f"num_bits {bits}, type {kind!r}, symmetric {symmetric}, actorder {order!r}")
    expect(strategy == "channel" or (strategy == "group" and isinstance(group, int) and group % int4.STAGE_K == 0),
           f"weights per channel or in groups of a multiple of {int4.STAGE_K} columns",
           f"strategy {strategy!r}, group_size {group!r}")
    return in_features if strategy == "channel" else min(group, in_features)


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """int8 [rows, columns] in -8..7 of pack-quantized int32 words (value + 8 at bits 4i of word i / 8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :columns] - int4.OFFSET).to(torch.int8)


def _kept_of_four_bit(q: torch.Tensor) -> torch.Tensor:
    """The 2:4 mask of 4-bit values: their non-zeros (at most two of every four: the error names
    the first group with more), filled up to two a group with zeros, the first ones first."""
    groups = q.reshape(q.shape[0], -1, 4) != 0
    count = groups.sum(-1)
    bad = (count > 2).nonzero()
    if bad.numel():
        row, group = (int(i) for i in bad[0])
        expect(False, "4-bit values 2:4 (at most 2 non-zero in every group of 4 columns)",
               f"{int(count[row, group])} at row {row}, columns {4 * group}..{4 * group + 3}")
    # zeros to keep: each group's first (2 - count) zero positions
    zeros_before = torch.cumsum((~groups).int(), -1)
    filled = groups | (~groups & (zeros_before <= (2 - count).unsqueeze(-1)))
    return filled.reshape(q.shape)


def _check_entry(key: str, value: torch.Tensor, current: torch.Tensor, allow_nonfinite: bool) -> None:
    """One of the checkpoint's other tensors against the model's: its shape, and a dtype of
    the same kind (floating into floating is cast, as load_state_dict does; anything else
    must match: an int64 tensor for a float one is no weight)."""
    expect(tuple(value.shape) == tuple(current.shape), f"{key} of shape {tuple(current.shape)} (the model's)",
           tuple(value.shape))
    same_kind = value.is_floating_point() and current.is_floating_point() and value.element_size() > 1
    expect(same_kind or value.dtype == current.dtype, f"{key} of dtype {current.dtype} (the model's)", value.dtype)
    _check_finite(key, value, allow_nonfinite)
