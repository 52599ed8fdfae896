"""What every layout's GPU calls share: which tensors run kernels at all, input and output
checks, the rows of X as a 2-D operand, cuBLAS on a dense copy of W (the dense path), and
tensors derived once per layout from an index.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import dense_path, kept_index, library, outside_graphs, runtime
from ..jit import epilogues, registry
from ..errors import InputError, expect
from ..jit.spec import ARCHS

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def check_inputs(x: torch.Tensor, values: torch.Tensor, bias, in_features: int) -> None:
    """Every "Expected X. Got Y." check, before any kernel runs. The common, valid case is
    decided by one cheap test; the messages are only built when something is wrong."""
    if (isinstance(x, torch.Tensor) and x.dtype is values.dtype and x.device == values.device
            and x.dim() >= 1 and x.shape[-1] == in_features and x.dtype in DTYPE_NAMES
            and (bias is None or (bias.dtype is values.dtype and bias.device == values.device))):
        return
    _explain_bad_inputs(x, values, bias, in_features)


def _explain_bad_inputs(x, values, bias, in_features: int) -> None:
    expect(isinstance(x, torch.Tensor), "input to be a torch.Tensor", type(x).__name__)
    expect(x.dim() >= 1 and x.shape[-1] == in_features,
           f"input of shape (..., {in_features})", tuple(x.shape))
    expect(x.dtype == values.dtype, f"input dtype {values.dtype} (the layer's dtype)", x.dtype)
    expect(x.device == values.device, f"input on {values.device} (the layer's device)", x.device)
    if values.is_cuda:
        expect(x.dtype in DTYPE_NAMES, f"a dtype in {list(DTYPE_NAMES)} on the GPU", x.dtype)
    if bias is not None:
        expect(bias.dtype == values.dtype and bias.device == values.device,
               f"bias of dtype {values.dtype} on {values.device}", f"{bias.dtype} on {bias.device}")


def kernel_left_to_dispatch(tile=None, instr=None, acc: str = "f32") -> bool:
    """Whether a call names none of its kernel (tile, family, accumulator): only then is its
    plan kept per signature and may the dense path or a per-call variant replace the kernel."""
    return tile is None and instr is None and acc == "f32"


@functools.lru_cache(maxsize=None)
def has_kernels(device_index: int) -> bool:
    """Whether sparsegen's templates cover this GPU (sm_80 and later, as ARCHS lists).
    Older or unknown GPUs run the PyTorch reference instead, with one warning."""
    arch = runtime.device_arch(torch.device("cuda", device_index))
    if arch in ARCHS:
        return True
    warnings.warn(f"sparsegen: no kernels for sm_{arch} (supported: {', '.join(f'sm_{a}' for a in ARCHS)}); "
                  "using the PyTorch reference on this GPU.", RuntimeWarning, stacklevel=3)
    return False


SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def runs_16bit_kernels(t: torch.Tensor) -> bool:
    """A float16/bfloat16 CUDA tensor on a GPU the templates cover (the 2:4 kernels' domain)."""
    return _on_covered_gpu(t, SIXTEEN_BIT)


def _on_covered_gpu(t: torch.Tensor, dtypes: tuple) -> bool:
    return t.is_cuda and t.dtype in dtypes and has_kernels(t.device.index or 0)


def define_product(op: str, implementation):
    """The torch.library op of a registered forward product, its schema and fake result read
    from the arguments its layout declared (registry.ProductArgs)."""
    args = registry.op_rules(op).args
    return library.define(args.schema(op), implementation, lambda *values: fake_product(args, *values))


def fake_product(args: registry.ProductArgs, x, *rest):
    """A fake forward result: x's leading dims by the epilogue's output width."""
    out_features, epilogue = args.out_features_and_epilogue((x, *rest))
    return library.rows_by(x, epilogues.output_features(epilogue, out_features))


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    return x2


def _output(out, m: int, n: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=dtype, device=x.device)
    if not (out.is_contiguous() and out.numel() == m * n and out.dtype == dtype
            and out.device == x.device and out.data_ptr() % 16 == 0):
        _explain_bad_out(out, m * n, x.device, dtype)  # (formatting the message costs more than the call)
    return out.view(m, n)


def _explain_bad_out(out, elements: int, device, dtype: torch.dtype) -> None:
    raise InputError(f"Expected out: contiguous, 16-byte aligned, {elements} elements, {dtype} on {device}. "
                     f"Got {tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}, "
                     f"address % 16 = {out.data_ptr() % 16}.")


def output_for(x: torch.Tensor, x2: torch.Tensor, out, out_features: int, dtype: torch.dtype | None = None):
    """(Y [M, N] to write, Y in x's leading shape)."""
    y = _output(out, x2.shape[0], out_features, x, dtype or x.dtype)
    return y, y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)


# The dense path wins GPU time (crossovers); outside a CUDA graph a small call is bound by the
# host instead, and there the dense path costs more: F.linear's host path (cuBLAS heuristics)
# is heavier than our launch. On the H100 machine's host (24 stacked 1024x1024 bf16 layers,
# 16 tokens, no_grad, us a call): block-sparse kernels 20.2, their dense path 28.7; 2:4 kernels
# 22.0, dense path 44.9; nn.Linear 26.9. Below HOST_BOUND_FLOPS (about 30 us of a 16-bit GEMM
# on an H100, a slow host's cost of a call) a call keeps its kernels outside graphs, and takes
# the dense path (copy built while outside) once captured, where host time is gone.
HOST_BOUND_FLOPS = 2 ** 34


def dense_outside_graphs(m: int, k: int, n: int) -> bool:
    return 2 * m * k * n >= HOST_BOUND_FLOPS


def dense_now(plan) -> bool:
    """Whether a plan with the dense path takes it on this call (any layout's plan with dense and dense_eager)."""
    return plan.dense_eager or torch.cuda.is_current_stream_capturing()


def dense_result(x, x2, weight, bias, out, epilogue="none"):
    """Y = X W^T (+ bias) by cuBLAS on a dense weight, then the epilogue, into `out` or a new
    tensor. Like the kernels, it records no autograd (the layers' autograd Functions
    differentiate the ops)."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return dense_result(x, x2, weight, bias, out, epilogue)
    y, shaped = output_for(x, x2, out, epilogues.output_features(epilogue, weight.shape[0]))
    if epilogues.is_gated(epilogue):  # the product is twice Y's width
        epilogues.gated_into(y, F.linear(x2, weight, bias), epilogue)
    else:
        epilogues.apply_in_place(dense_path.linear_into(y, x2, weight, bias), epilogue)
    return shaped


def product_without_weight(x, x2, bias, out, out_features: int, epilogue: str, dtype=None):
    """What a product with no rows of X or no stored weight gives: the epilogue of the bias
    (or of zeros), in x's leading shape."""
    y, shaped = output_for(x, x2, out, epilogues.output_features(epilogue, out_features), dtype)
    z = bias.to(y.dtype).expand(y.shape[0], out_features) if bias is not None else y.new_zeros(y.shape[0], out_features)
    y.copy_(epilogues.reference(z, epilogue))
    return shaped


# Tensors derived from a layer's index that cost host work (or a sync) to build, kept while
# the index tensor they are keyed by lives (by identity: a layer rebuilds its index tensors
# when its layout changes; the stamp of data pointers and _version catches edits in place,
# and kept_index tells a rewrite with the same values - DDP's buffer broadcast - from a change).
_PER_LAYOUT = WeakIdKeyDictionary()


def per_layout(what: str, key: torch.Tensor, build, *inputs, reads_host: bool = False):
    """build(*inputs), remembered per (key tensor, what) until one of the tensor inputs changes.
    Not during CUDA graph capture: what a captured build allocates only holds its values when
    the graph replays. A build that reads the index on the host cannot run then at all."""
    stamp = tuple(kept_index.stamp_of(t) if isinstance(t, torch.Tensor) else t for t in inputs)
    entries = _PER_LAYOUT.setdefault(key, {})
    entry = entries.get(what)
    if entry is not None and (entry[0] == stamp or same_values(entry[2], inputs)):
        entries[what] = (stamp, *entry[1:])
        return entry[1]
    if key.is_cuda and torch.cuda.is_current_stream_capturing():
        expect(not reads_host, f"a warm-up call of the layer before CUDA graph capture (its {what} index is "
               "built on the host once per layout)", "a first call inside the capture")
        return build(*inputs)
    entries[what] = (stamp, outside_graphs.run(build, inputs, key.device), generations(inputs))
    return entries[what][1]


def generations(inputs: tuple) -> tuple:
    """What `inputs` hold now: each tensor's kept_index generation, anything else as it is."""
    return tuple(kept_index.generation(t) if isinstance(t, torch.Tensor) else t for t in inputs)


def same_values(kept: tuple, inputs: tuple) -> bool:
    """Whether `inputs` hold what they held when `kept` (generations) was taken: one comparison
    of every rewritten index at once (kept_index), and none for the later layers of a step.
    Deriving every layer's index again each step cost DDP's training step 0.77x of dense on 2
    H100s, where the same run without its buffer broadcast gave 1.09x."""
    return len(kept) == len(inputs) and all(
        kept_index.current(t) is k if isinstance(t, torch.Tensor) else t == k for k, t in zip(kept, inputs))


def fits_in_place(out: torch.Tensor) -> bool:
    """A buffer the kernels write in place: contiguous, 16-byte aligned."""
    return out.is_contiguous() and out.data_ptr() % 16 == 0


def tma_ready(t: torch.Tensor) -> bool:
    """Contiguous at a 16-byte aligned address: what aligned returns as it is."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def aligned(w: torch.Tensor) -> torch.Tensor:
    """w contiguous at a 16-byte aligned address: the prune kernels read rows in 8 or 16 bytes."""
    w = w.contiguous()
    return w.clone() if w.data_ptr() % 16 else w
