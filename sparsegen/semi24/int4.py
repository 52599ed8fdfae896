"""4-bit 2:4 weights (W4A16): the kept values of a 2:4 weight as signed 4-bit integers with a
16-bit scale per output row and group of input columns, symmetric (no zero point).

Dequantized weight: W[f, k] = (q[f, k] * scale[k // group, f]) rounded once to the scales'
dtype (bf16 or fp16) - exactly what the kernel feeds the tensor cores (templates/semi24/sg_int4.cuh),
so a float64 product of `dequantized` is the kernel's reference.

Storage, for the kernel's access pattern (one 32-bit shared-memory load per lane and
instruction, no ldmatrix): `qweight` int32 [N/16, K/32, 32]. Word l of line (R, t) holds the
8 values lane l's mma.sp A fragment takes from W's rows 16R.. and kept columns 16t..16t+15:
nibble h + 2c + 4p is row 16R + 8h + l // 4, kept column 16t + 8c + 2(l % 4) + p, stored as
q + 8 (0..15). `scales` [ceil(K / group), N] in the activations' dtype; `group` a multiple of
128 (the kernel's stage of K) or K itself (one scale per row: per channel). The metadata is
the 16-bit 2:4 layers' (format.pack_metadata).
"""
from __future__ import annotations

import torch

from ..errors import expect, integer
from . import format as semi24

STAGE_K = 128  # dense columns per kernel stage: a group holds whole stages
LARGEST = 7    # round-to-nearest of w / scale, scale = a group's largest magnitude / 7
OFFSET = 8     # a stored nibble is q + 8
SCALE_DTYPES = (torch.bfloat16, torch.float16)


def scale_dtype_for(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight of `weight_dtype` is pruned and scaled in: its own where it is a scale
    dtype, else bfloat16 (a float32 linear's)."""
    return weight_dtype if weight_dtype in SCALE_DTYPES else torch.bfloat16


def group_of(group_size: int | None, in_features: int) -> int:
    """The columns one scale covers: group_size (a positive multiple of 128), or all of them
    for -1 or None (a scale per output channel, GPTQ's -1)."""
    if group_size is None or group_size == -1:
        return in_features
    group = integer(group_size, "group_size")
    expect(group > 0 and group % STAGE_K == 0, f"group_size a positive multiple of {STAGE_K}, or -1 "
           "(one scale per output channel)", repr(group_size))
    return min(group, in_features)


def groups(in_features: int, group: int) -> int:
    return -(-in_features // group)


def _by_group(kept: torch.Tensor, group: int) -> torch.Tensor:
    """Kept values [N, K/2] as [N, groups, group/2] (the last group padded with zeros)."""
    n, half = kept.shape
    count, per = groups(2 * half, group), group // 2
    padded = torch.nn.functional.pad(kept, (0, count * per - half))
    return padded.reshape(n, count, per)


def quantize(kept: torch.Tensor, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q + 8 as uint8 [N, K/2], scales [groups, N] in dtype) of kept values [N, K/2]; each
    scale is rounded to dtype first, and the values are quantized by the rounded scale."""
    expect(dtype in SCALE_DTYPES, f"a scale dtype in {list(SCALE_DTYPES)}", dtype)
    grouped = _by_group(kept.detach().float(), group)
    largest = grouped.abs().amax(-1)
    scales = (largest / LARGEST).clamp_min(torch.finfo(dtype).tiny).to(dtype)
    q = (grouped / scales.float().unsqueeze(-1)).round().clamp(-OFFSET, LARGEST) + OFFSET
    q = q.reshape(kept.shape[0], -1)[:, :kept.shape[1]].to(torch.uint8)
    return q, scales.t().contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Kept values [N, K/2] in the scales' dtype: (q - 8) * scale, rounded once."""
    n, half = q.shape
    per_value = scales.t().repeat_interleave(group // 2, dim=1)[:, :half]
    return (q.to(torch.int16) - OFFSET).to(scales.dtype) * per_value


def pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [N, K/2] (0..15) as the kernel's int32 words [N/16, K/32, 32]."""
    n, half = q.shape
    # [R, h, g, t, c, q, p] -> [R, t, g, q, p, c, h]: a lane's 8 nibbles, nibble h + 2c + 4p last
    nibbles = q.reshape(n // 16, 2, 8, half // 16, 2, 4, 2).permute(0, 3, 2, 5, 6, 4, 1).reshape(-1, 2)
    octets = (nibbles[:, 0] | (nibbles[:, 1] << 4)).to(torch.uint8)
    return octets.reshape(n // 16, half // 16, 32, 4).contiguous().view(torch.int32).reshape(n // 16, half // 16, 32)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack's inverse: uint8 nibbles [N, K/2]."""
    rows16, tiles, _ = words.shape
    octets = words.contiguous().view(torch.uint8).reshape(-1, 1)
    nibbles = torch.cat([octets & 0xF, octets >> 4], dim=1)
    return nibbles.reshape(rows16, tiles, 8, 4, 2, 2, 2).permute(0, 6, 2, 1, 5, 3, 4).reshape(16 * rows16, 16 * tiles)


def check_parts(qweight, metadata, scales, shape: tuple[int, int], group: int) -> None:
    """Parts from outside (a constructor's, a state_dict's): types and shapes, metadata words
    mma.sp can read, finite scales above 0."""
    n, k = shape
    semi24.check_shape(shape)
    want = (n // 16, k // 32, 32)
    expect(isinstance(qweight, torch.Tensor) and qweight.dtype == torch.int32 and tuple(qweight.shape) == want,
           f"qweight int32 of shape {want}", _described(qweight))
    expect(isinstance(scales, torch.Tensor) and scales.dtype in SCALE_DTYPES
           and tuple(scales.shape) == (groups(k, group), n),
           f"scales bfloat16 or float16 of shape {(groups(k, group), n)}", _described(scales))
    semi24.check_metadata(metadata, shape)
    if not scales.is_meta:
        expect(bool(torch.isfinite(scales).all()) and not bool((scales <= 0).any()), "finite scales above 0",
               f"values from {scales.float().min().item():g} to {scales.float().max().item():g}")


def _described(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
