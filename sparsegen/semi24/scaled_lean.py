"""One-byte 2:4 calls straight to their launches: ScaledSparse24Linear's lean path, and the
packed activation quantization it shares with compiled graphs.

An eager decode step is bound by the host. A one-byte layer's eager call went through the
compiled graphs' launcher (a registry lookup, plan caches keyed on every call, a function per
launch): on the H200 machine's host FP8 2:4 generate() ran at 0.91-0.95x bf16 dense where bf16
2:4, on launch/lean.py's path, ran at 1.03-1.16x (tools/bench_generate.py --profile: 135 us a
call under cProfile against 44). The layer now plans once per input signature (lean.LeanLayer)
and each later call makes one launch - a product that quantizes X itself, up to
ops.QUANTIZING_ROWS tokens - or two: the packed sp24_quantize, then the scaled product.
"""
from __future__ import annotations

import torch

from ..launch import runtime
from . import dispatch, ops

# Inductor's own allocator (a C++ call; torch.empty costs a few us more per tensor on a slow
# host). It allocates on the current device, so callers check that it is X's.
try:
    from torch._C._dynamo.guards import _empty_strided_cuda
except ImportError:  # a torch without it: torch.empty
    _empty_strided_cuda = None
_QUANTIZE_LAUNCHES: dict = {}


def quantize_packed(x, m: int, k: int, dtype: torch.dtype, input_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.sp24_quantize of x (contiguous, [m, k] in any shape; ops.quantizes_on_kernel holds),
    its launch packed once per (dtype, shape, device) and shared by every layer."""
    device_index = x.get_device()
    if _empty_strided_cuda is not None and runtime.current_device() == device_index:
        xq, scales = _empty_strided_cuda((m, k), (k, 1), dtype), _empty_strided_cuda((m,), (1,), torch.float32)
    else:
        xq = torch.empty((m, k), dtype=dtype, device=x.device)
        scales = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        key = (dtype, x.dtype, device_index, m, k)
        launch = _QUANTIZE_LAUNCHES.get(key) or _QUANTIZE_LAUNCHES.setdefault(key, _quantize_launch(*key))
        pointers = launch.pointers
        with launch.lock:
            pointers[0], pointers[1] = x.data_ptr(), 0 if input_scale is None else input_scale.data_ptr()
            pointers[2], pointers[3] = xq.data_ptr(), scales.data_ptr()
            launch.run()
    return xq, scales


def _quantize_launch(dtype, source, device_index: int, m: int, k: int) -> runtime.PackedLaunch:
    kern = dispatch.quantize_kernel(dtype, source, device_index)
    return runtime.PackedLaunch(kern, (m, 1, 1), (), (0, 0, 0, 0), (k,))


class ScaledLeanPlan:
    """A one-byte layer's launches for one input signature (lean.LeanCall's plan). The scales
    are read from the layer's buffers on every call, so a loaded or reassigned scale counts.

    `dense` is what lean.runs reads as "a CUDA graph capture takes the full path": set for a
    quantizing product, whose graphs run faster as two kernels (ops.quantizes_in_product)."""

    __slots__ = ("product", "buffers", "rows", "k", "byte_dtype", "code", "width", "dense")

    def __init__(self, product, buffers: dict, rows: int, k: int, byte_dtype, code: int | None):
        self.product, self.buffers, self.rows, self.k = product, buffers, rows, k
        self.byte_dtype, self.code, self.width = byte_dtype, code, product.width
        self.dense = code is None

    def run(self, x: torch.Tensor, values, bias, y: torch.Tensor) -> None:
        buffers = self.buffers
        bias_at = 0 if bias is None else bias.data_ptr()
        if self.code is None:  # the product quantizes X (its scales: static, or per token where None)
            self.product.run_at(x.data_ptr(), bias_at, y.data_ptr(), (buffers["input_scale"], buffers["weight_scale"], None))
            return
        xq, x_scale = quantize_packed(x, self.rows, self.k, self.byte_dtype, buffers["input_scale"])
        self.product.run_at(xq.data_ptr(), bias_at, y.data_ptr(), (x_scale, buffers["weight_scale"], self.code))


def plan(x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, buffers: dict,
         epilogue: str) -> ScaledLeanPlan | None:
    """The lean plan of a ScaledSparse24Linear (its `buffers`) for x's signature - x a 16-bit
    CUDA tensor as scaled._launches_as_compiled accepts - or None: its calls take the full path."""
    k = x.shape[-1]
    rows = x.numel() // k
    if not (ops.runs_byte_kernels(values) and k % 8 == 0):
        return None
    example = torch.empty((rows, k), dtype=x.dtype, device=x.device)  # (contiguous and aligned; runs() checks x per call)
    product = ops.sp24_quantizing_lean_plan(example, values, metadata, values.shape[0], epilogue)
    if product is not None:
        return ScaledLeanPlan(product, buffers, rows, k, values.dtype, None)
    code = ops.SCALED_OUTPUT_CODES[x.dtype]
    quantized = torch.empty((rows, k), dtype=values.dtype, device=x.device)
    product = ops.sp24_scaled_lean_plan(quantized, values, metadata, values.shape[0], epilogue, code)
    return None if product is None else ScaledLeanPlan(product, buffers, rows, k, values.dtype, code)
