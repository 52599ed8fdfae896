"""Sparse24Tensor: a 2:4 semi-structured matrix as the mma.sp kernels read it."""
from __future__ import annotations

import torch

from ..launch import calls
from .. import env
from ..errors import expect
from . import format as semi24
from . import ops
from .autograd import sp24_any_device


class Sparse24Tensor:
    """W [N, K], 2:4 along rows: `values` [N, K/2] and `metadata` [N/16, K/32, 16] int32
    (layouts/semi24.py). Build one with `sparsegen.to_sparse24`."""

    def __init__(self, values: torch.Tensor, metadata: torch.Tensor, shape: tuple[int, int]):
        self.values, self.metadata, self.shape = values, metadata, tuple(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def mask(self) -> torch.Tensor:
        """Where the stored elements sit (the dense positions kept, zeros included)."""
        n, k = self.shape
        positions = semi24.stored_positions(self.metadata, n, k)
        mask = torch.zeros(n, k // 4, 4, dtype=torch.bool, device=self.device)
        return mask.scatter_(-1, positions, True).reshape(n, k)

    def to_dense(self) -> torch.Tensor:
        return semi24.decompress(self.values, self.metadata, self.shape)

    def t(self) -> "Sparse24Tensor":
        """W^T as a Sparse24Tensor: only when the mask is 2:4 along columns too
        (method="transposable" gives such masks)."""
        dense, mask = self.to_dense().t(), self.mask.t()
        semi24.check_shape(dense.shape, "transposed weight", semi24.col_granule(self.dtype))
        expect(bool((mask.reshape(mask.shape[0], -1, 4).sum(-1) <= 2).all()),
               "a mask that is 2:4 along columns as well (to_sparse24(..., method='transposable'))",
               "a mask with more than 2 kept in some group of 4 rows")
        return Sparse24Tensor(*compress_masked(dense, mask), dense.shape)  # the views as they are

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias): the mma.sp kernel for 16-bit CUDA tensors, else PyTorch. One-byte
        weights take x of their dtype and return int32 (int8) or bfloat16 (float8_e4m3fn);
        bias, if any, is of that output dtype; scaling is the caller's."""
        if self.dtype in semi24.BYTE_DTYPES:
            ops.check_byte_inputs(x, self.values, bias, self.shape)
            if ops.runs_byte_kernels(x):
                return ops.sp24_dds(x, self.values, self.metadata, bias, self.shape[0])
            return byte_reference(x, self.values, self.metadata, bias, self.shape[0])
        calls.check_inputs(x, self.values, bias, self.shape[1])
        return sp24_any_device(x, self.values, self.metadata, bias, self.shape[0])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """F.linear(x, sparse_weight, bias) works, as with PyTorch's semi-structured tensors."""
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2 and isinstance(args[1], cls):
            return args[1].linear(args[0], args[2] if len(args) > 2 else kwargs.get("bias"))
        return NotImplemented

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.metadata.numel() * 4

    def __repr__(self) -> str:
        return f"Sparse24Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def to_sparse24(tensor: torch.Tensor, method: str = "magnitude", mask: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> Sparse24Tensor:
    """Prune a 2-D fp16/bf16 tensor to 2:4 and compress it.

    method: "magnitude" (keep the 2 largest of every 4), "mvue" (random, unbiased:
    E[to_dense()] = tensor), "transposable" (2:4 along rows and columns, so .t() works);
    or pass a boolean `mask` (validated: at most 2 kept in every group of 4)."""
    expect(isinstance(tensor, torch.Tensor), "a torch.Tensor", type(tensor).__name__)
    semi24.check_dtype(tensor.dtype, byte_types=True)
    semi24.check_shape(tensor.shape, "tensor", semi24.col_granule(tensor.dtype))
    if tensor.dtype in semi24.BYTE_DTYPES and mask is None:
        expect(method != "mvue", f"method 'magnitude', 'transposable' or a mask for {tensor.dtype} (MVUE's "
               "rescaled values do not fit one-byte types)", repr(method))
    return Sparse24Tensor(*prune_and_compress(tensor, method, mask, generator), tensor.shape)


def byte_reference(x, values, metadata, bias, out_features: int) -> torch.Tensor:
    """The one-byte product in float64 (exact for int8 sums below 2**53), rounded to the
    kernel's output dtype: the CPU path and the tests' reference."""
    weight = semi24.decompress(values, metadata, (out_features, x.shape[-1]))
    y = x.double() @ weight.double().t()
    return (y if bias is None else y + bias.double()).to(ops.sp24_output_dtype(x.dtype))


def on_kernels(w: torch.Tensor) -> bool:
    """Prune and pack with the generated kernels (a CUDA 16-bit or one-byte weight), else PyTorch ops."""
    return ops.runs_prune_kernels(w) and env.compress_kernel()


def compress_masked(w: torch.Tensor, mask: torch.Tensor):
    """(values, metadata) of w at a mask already known to be 2:4 (no check, no host sync):
    the training layers' per-step path."""
    if on_kernels(w):
        return ops.sp24_compress(w.detach(), mask)
    return semi24.compress(w.detach().contiguous(), mask.contiguous())


def prune_mask(w: torch.Tensor, method: str) -> torch.Tensor:
    """The "magnitude" or "transposable" 2:4 mask of w (the transposable one by a kernel on
    the GPU)."""
    if method == "transposable":
        return ops.sp24_transposable_mask(w) if on_kernels(w) else semi24.transposable_mask(w)
    return semi24.magnitude_mask(w)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 64-bit seed for the MVUE kernel, drawn from `generator` (else torch's default CPU
    generator, so torch.manual_seed makes runs repeat)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(-2**63, 2**63 - 1, (), generator=generator, device=device))


@torch.no_grad()
def prune_and_compress(w: torch.Tensor, method: str = "magnitude", mask=None, generator=None):
    """(values, metadata) of w pruned by `method` or `mask`: for a CUDA 16-bit weight by the
    generated sp24_mask / sp24_compress kernels, otherwise in PyTorch ops (any device)."""
    w = w.detach()
    if mask is None:
        semi24.check_method(method)
    if not on_kernels(w):
        pruned, keep = semi24.prune(w, method, mask, generator)
        return semi24.compress(pruned.contiguous(), keep.to(w.device).contiguous())
    if mask is not None:
        return ops.sp24_compress(w, semi24.check_mask(mask, w.shape).to(w.device))
    if method == "mvue":
        return ops.sp24_compress(w, mvue_seed=draw_seed(generator))
    return ops.sp24_compress(w, prune_mask(w, method) if method == "transposable" else None)
