"""2:4 semi-structured sparsity: masks, compression, and the metadata layout `mma.sp` reads.

A weight W [N, K] is 2:4 when every group of 4 consecutive elements of a row holds at most
2 nonzeros. It is stored as
- values [N, K / 2]: the 2 kept elements of each group, in column order;
- metadata [N / 16, K / 32, 16] int32: for each 16-row x 32-column tile (one operand A of
  `mma.sp...m16n8k32`) the 16 words that lanes 4g + h (g = 0..7, h = 0..1) pass as the
  instruction's metadata operand with sparsity selector 0, at index 2g + h.
Each group's 2 kept positions (0..3, increasing, as `::ordered_metadata` asks) make a
nibble: first index in bits 0-1, second in bits 2-3. Which nibbles a lane's word holds is
noted below; `word_nibbles` is the CPU model of that rule the tests check against.

Everything here is plain PyTorch, so it runs on the CPU and, as it is, on the GPU.
"""
from __future__ import annotations

import functools
import itertools

import torch

from ..errors import expect, integer

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # kernels: the 16-bit ones
# One-byte types: Sparse24Tensor inference only (mma.sp m16n8k64: int8 -> int32, e4m3 -> bf16).
BYTE_DTYPES = (torch.int8, torch.float8_e4m3fn)
ROW_GRANULE, COL_GRANULE = 16, 32  # one mma.sp m16n8k32 A tile
BYTE_COL_GRANULE = 64  # one m16n8k64 A tile, the one-byte instruction

# Lane 4g + h of a warp supplies one metadata word per 16 x 32 tile: its low 16 bits are
# row g's four groups in columns 16h..16h+15, its high 16 bits row g + 8's (the m16n8k16
# rule, once per k16 half). Checked on an H200: a word per row (all 8 groups of row g + 8h)
# is not what the hardware reads (tests/test_gpu_sp24.py checks element by element).
# One-byte types (mma.sp m16n8k64 and wgmma.sp k64: all four lanes supply) do read a word
# per row: lane 4g + 2t + u
# wants row g + 8u's 8 groups of k32 tile t. The kernel builds it from stored words 2g and
# 2g + 1 (one byte permute), so every dtype shares this one storage layout (probed on an H100).


def check_shape(shape, what: str = "weight", cols: int = COL_GRANULE) -> None:
    expect(len(shape) == 2, f"a 2-D {what} [out_features, in_features]", tuple(shape))
    n, k = (integer(side, f"the {what}'s sides") for side in shape)
    expect(n > 0 and k > 0 and n % ROW_GRANULE == 0 and k % cols == 0,
           f"a {what} whose rows are a positive multiple of {ROW_GRANULE} and columns of {cols} "
           f"(one mma.sp m16n8k{cols} tile)", tuple(shape))


def col_granule(dtype: torch.dtype) -> int:
    return BYTE_COL_GRANULE if dtype in BYTE_DTYPES else COL_GRANULE


def check_dtype(dtype: torch.dtype, byte_types: bool = False) -> None:
    """Layers take DTYPES; Sparse24Tensor (byte_types) also int8 and float8_e4m3fn."""
    allowed = DTYPES + BYTE_DTYPES if byte_types else DTYPES
    note = "" if byte_types else " (int8 and float8_e4m3fn: sparsegen.to_sparse24 for inference)"
    expect(dtype in allowed, f"a dtype in {list(allowed)}{note}", dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte tensors as uint8, so gathers and scatters need no float8 kernels."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _from_raw(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """_raw's inverse (a no-op for wider types, which keeps autograd's graph)."""
    return raw.view(dtype) if raw.dtype != dtype else raw


def gather_kept(dense: torch.Tensor, metadata: torch.Tensor) -> torch.Tensor:
    """[N, K/2]: the elements of `dense` at the positions `metadata` stores (a gradient)."""
    n, k = dense.shape
    return torch.gather(_groups(dense), -1, stored_positions(metadata, n, k)).reshape(n, k // 2)


def _groups(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], t.shape[1] // 4, 4)


def check_mask(mask: torch.Tensor, shape) -> torch.Tensor:
    """A user mask: boolean, the weight's shape, at most 2 kept of every 4 along rows."""
    expect(isinstance(mask, torch.Tensor) and mask.dtype == torch.bool, "a boolean mask tensor",
           getattr(mask, "dtype", type(mask).__name__))
    expect(tuple(mask.shape) == tuple(shape), f"a mask of shape {tuple(shape)}", tuple(mask.shape))
    kept = _groups(mask).sum(-1)
    bad = (kept > 2).nonzero()
    expect(bad.numel() == 0, "a 2:4 mask (at most 2 kept in every group of 4 columns)",
           f"{int(kept.max())} kept in the group at row {int(bad[0, 0])}, columns "
           f"{4 * int(bad[0, 1])}..{4 * int(bad[0, 1]) + 3}" if bad.numel() else "")
    return mask


def check_metadata(metadata, shape) -> torch.Tensor:
    """Metadata from outside (a state_dict): int32 words of the weight's tiles whose every
    nibble is a selection mma.sp can read, two increasing positions of 0..3 (a nibble such
    as 0xF, the same position twice, is not). The InputError names the first bad group."""
    n, k = shape
    want = (n // ROW_GRANULE, k // COL_GRANULE, 16)
    expect(isinstance(metadata, torch.Tensor) and metadata.dtype == torch.int32, "int32 2:4 metadata",
           getattr(metadata, "dtype", type(metadata).__name__))
    expect(tuple(metadata.shape) == want, f"metadata of shape {want} for a [{n}, {k}] weight", tuple(metadata.shape))
    if metadata.is_meta:  # a model built without memory: no words to read (a load checks them)
        return metadata
    positions = stored_positions(metadata, n, k)
    bad = (positions[..., 0] >= positions[..., 1]).nonzero()
    if bad.numel():
        row, group = (int(v) for v in bad[0])
        first, second = (int(v) for v in positions[row, group])
        expect(False, "metadata selecting two increasing positions 0..3 in every group of 4 columns",
               f"positions ({first}, {second}) (nibble {first | second << 2:#x}) in the group at row {row}, "
               f"columns {4 * group}..{4 * group + 3}")
    return metadata


def _ranks(keys: torch.Tensor) -> torch.Tensor:
    """Per group of 4 (last dim), each element's rank by descending key, ties to the lower
    index: twelve elementwise comparisons, no sort (sorting 4-element rows is slow on GPUs)."""
    k = keys.float().unbind(-1)
    ranks = [sum(((k[j] > k[i]) if j > i else (k[j] >= k[i])).to(torch.uint8) for j in range(4) if j != i)
             for i in range(4)]
    return torch.stack(ranks, dim=-1)


def magnitude_mask(w: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest |w| of every 4 (the first of equal ones, as the kernel does)."""
    return (_ranks(_groups(_magnitudes(w))) < 2).reshape(w.shape)


def _magnitudes(w: torch.Tensor) -> torch.Tensor:
    return w.float().abs() if w.dtype in BYTE_DTYPES else w.abs()


def mvue(w: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random 2:4 tensor with E[result] = w (2by4-pretrain's estimator): each pair (a, b)
    of a group keeps one element, a with probability |a| / (|a| + |b|), scaled to
    sign * (|a| + |b|). Pairs of zeros stay zero."""
    pairs = w.reshape(w.shape[0], -1, 2).float()
    size = pairs.abs().sum(-1, keepdim=True)
    p_first = torch.where(size > 0, pairs[..., :1].abs() / size.clamp_min(1e-30), torch.full_like(size, 0.5))
    draw = torch.rand(p_first.shape, device=w.device, generator=generator)
    keep_first = draw < p_first
    choice = torch.cat([keep_first, ~keep_first], dim=-1)
    return (torch.where(choice, pairs.sign() * size, torch.zeros_like(pairs))).reshape(w.shape).to(w.dtype)


# The 6 ways a group of 4 keeps 2, as position pairs, and the 90 transposable 4 x 4 patterns
# as one pair index per row (2 kept in every column too). The order is the argmax order, so
# the CPU path and the generated sp24_mask kernel break ties alike.
ROW_PAIRS = tuple((i, j) for i, j in reversed(list(itertools.combinations(range(4), 2))))
TRANSPOSABLE_PATTERNS = tuple(p for p in itertools.product(range(6), repeat=4)
                              if all(sum(c in ROW_PAIRS[r] for r in p) == 2 for c in range(4)))


@functools.lru_cache(maxsize=None)
def _transposable_patterns() -> torch.Tensor:
    """TRANSPOSABLE_PATTERNS as [90, 16] 0/1 rows (a tile's elements, row-major)."""
    dense = [[float(c in ROW_PAIRS[r]) for r in pattern for c in range(4)] for pattern in TRANSPOSABLE_PATTERNS]
    return torch.tensor(dense)


def transposable_mask(w: torch.Tensor) -> torch.Tensor:
    """Per 4x4 tile, the pattern 2:4 along rows and along columns keeping the most |w|:
    W and W^T are both 2:4 (dX = dY W runs on the same sparse kernel)."""
    n, k = w.shape
    expect(n % 4 == 0, "out_features a multiple of 4 for a transposable mask", n)
    tiles = _magnitudes(w).float().reshape(n // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    patterns = _transposable_patterns().to(w.device)
    best = patterns[(tiles @ patterns.t()).argmax(-1)].bool()
    return best.reshape(n // 4, k // 4, 4, 4).permute(0, 2, 1, 3).reshape(n, k)


def _positions_table() -> torch.Tensor:
    """[16, 2]: for each 4-bit keep pattern, the 2 positions stored (increasing): the kept
    ones first, padded with the first unkept ones."""
    rows = []
    for code in range(16):
        kept = [i for i in range(4) if code >> i & 1][:2]
        kept += [i for i in range(4) if i not in kept][:2 - len(kept)]
        rows.append(sorted(kept))
    return torch.tensor(rows)


_POSITIONS = _positions_table()


def kept_positions(mask: torch.Tensor) -> torch.Tensor:
    """[N, K/4, 2]: the 2 stored positions of each group, increasing. Groups with fewer
    than 2 kept also store their first unkept positions (as zeros). A table lookup on each
    group's 4-bit pattern: no sort."""
    code = (_groups(mask).to(torch.uint8) << torch.arange(4, device=mask.device, dtype=torch.uint8)).sum(-1)
    return _POSITIONS.to(mask.device)[code.long()]


def compress(w: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, K/2], metadata [N/16, K/32, 16] int32) of w where mask holds."""
    positions = kept_positions(mask)
    values = torch.gather(_groups(_raw(w) * mask), -1, positions).reshape(w.shape[0], -1)
    return _from_raw(values, w.dtype).contiguous(), pack_metadata(positions)


def scatter_kept(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """compress's inverse at a mask with exactly 2 kept of every 4: the dense tensor with
    `values` (row by row, in column order) where `mask` holds."""
    raw = _raw(values)
    dense = torch.zeros(mask.shape, dtype=raw.dtype, device=values.device)
    dense[mask] = raw.reshape(-1)
    return _from_raw(dense, values.dtype)


def check_loaded_metadata(state_dict: dict, prefix: str, shape) -> None:
    """A layer's _check_state: metadata from a file is checked before it is copied (a nibble
    mma.sp cannot read never reaches a kernel, and the layer is never left half-loaded)."""
    metadata = state_dict.get(prefix + "metadata")
    if metadata is not None:
        check_metadata(metadata, shape)


def _nibbles(positions: torch.Tensor) -> torch.Tensor:
    return (positions[..., 0] | (positions[..., 1] << 2)).to(torch.int64)


def pack_metadata(positions: torch.Tensor) -> torch.Tensor:
    """The lane words of every 16 x 32 tile (see the layout note above)."""
    n, groups = positions.shape[:2]
    # [tile row R, upper (rows + 8), g, tile col J, k16 half h, group j]
    nib = _nibbles(positions).reshape(n // 16, 2, 8, groups // 8, 2, 4)
    halves = (nib << 4 * torch.arange(4, device=nib.device)).sum(-1)          # [R, u, g, J, h]
    words = (halves << torch.tensor([0, 16], device=nib.device).reshape(1, 2, 1, 1, 1)).sum(1)
    words = words.permute(0, 2, 1, 3)                                          # [R, J, g, h]
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)              # int32 bits
    return words.reshape(n // 16, groups // 8, 16).to(torch.int32).contiguous()


def word_nibbles(word: int, lane: int) -> dict[tuple[int, int], int]:
    """The CPU model of how mma.sp reads one lane's metadata word: {(row, group): nibble}
    for rows 0..15 and groups 0..7 (columns 4*group..4*group+3) of the 16 x 32 tile."""
    g, h = lane // 4, lane % 4
    if h > 1:
        return {}  # sparsity selector 0: lanes 4g+2 and 4g+3 supply nothing
    return {(g + 8 * upper, 4 * h + j): (word >> (16 * upper + 4 * j)) & 0xF
            for upper in range(2) for j in range(4)}


def unpack_metadata(metadata: torch.Tensor) -> torch.Tensor:
    """[N, K/4, 2] positions back from the words, lane by lane through `word_nibbles`."""
    tiles_r, tiles_c, _ = metadata.shape
    positions = torch.empty(tiles_r * 16, tiles_c * 8, 2, dtype=torch.long)
    for r, c in itertools.product(range(tiles_r), range(tiles_c)):
        for lane in range(32):
            word = int(metadata[r, c, 2 * (lane // 4) + lane % 4]) & 0xFFFFFFFF if lane % 4 < 2 else 0
            for (row, group), nib in word_nibbles(word, lane).items():
                positions[16 * r + row, 8 * c + group] = torch.tensor([nib & 3, nib >> 2])
    return positions


def decompress(values: torch.Tensor, metadata: torch.Tensor, shape) -> torch.Tensor:
    """The dense [N, K] tensor (vectorized: the kernels' own reading is tested elsewhere)."""
    n, k = shape
    positions, raw = stored_positions(metadata, n, k), _raw(values)
    dense = torch.zeros(n, k // 4, 4, dtype=raw.dtype, device=values.device)
    return _from_raw(dense.scatter_(-1, positions, raw.reshape(n, k // 4, 2)).reshape(n, k), values.dtype)


def stored_positions(metadata: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, K/4, 2]: the positions the metadata stores (pack_metadata's inverse, vectorized)."""
    words = (metadata.to(torch.int64) & 0xFFFFFFFF).reshape(n // 16, k // 32, 8, 2)  # [R, J, g, h]
    nib = (words[..., None] >> 4 * torch.arange(8, device=metadata.device)) & 0xF     # [R, J, g, h, 8]
    nib = nib.reshape(n // 16, k // 32, 8, 2, 2, 4).permute(0, 4, 2, 1, 3, 5)       # [R, u, g, J, h, j]
    nib = nib.reshape(n, k // 4)
    return torch.stack([nib & 3, nib >> 2], dim=-1)


METHODS = ("magnitude", "mvue", "transposable")


def check_method(method) -> None:
    expect(method in METHODS, f"method in {list(METHODS)} or a mask", repr(method))


def prune(w: torch.Tensor, method: str = "magnitude", mask: torch.Tensor | None = None,
          generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pruned weight, its mask) by `method` or the given `mask`."""
    if mask is not None:
        return w, check_mask(mask, w.shape)
    if method == "magnitude":
        return w, magnitude_mask(w)
    if method == "transposable":
        return w, transposable_mask(w)
    check_method(method)
    sampled = mvue(w, generator)
    return sampled, _pair_mask(sampled)


def _pair_mask(sampled: torch.Tensor) -> torch.Tensor:
    """MVUE keeps one element per pair, even where it is zero: one True per pair."""
    pairs = sampled.reshape(sampled.shape[0], -1, 2)
    first = pairs[..., 0] != 0
    return torch.stack([first, ~first], dim=-1).reshape(sampled.shape)
