"""A GPU machine with no NVRTC and a read-only cache runs layers from a kernel bundle alone.

Usage: python tools/bundle_check.py BUNDLE_DIR. NVRTC is made unimportable before sparsegen
loads, so any kernel the bundle lacks fails the run (ImportError) instead of compiling.
Checks forward and backward of block-sparse and 2:4 layers at several token counts against
float64; prints one line per case and exits 1 on any failure.
"""
import os
import sys

sys.modules["cuda.bindings.nvrtc"] = None  # as on a machine without NVRTC

import torch  # noqa: E402

import sparsegen  # noqa: E402
from sparsegen import env  # noqa: E402

CASES = [("b32", dict(block=(32, 32), density=0.5)), ("b64", dict(block=(64, 64), density=0.25)),
         ("b128", dict(block=(128, 128), density=0.25)), ("2:4", dict(sparsity="2:4"))]
TOKENS = (1, 8, 64, 512, 4096)


def reference(layer, x):
    return x.double() @ layer.to_dense_weight().double().T + layer.bias.double()


def check(label: str, options: dict, dtype: torch.dtype, m: int) -> bool:
    torch.manual_seed(m)
    layer = sparsegen.linear(1024, 2048, dtype=dtype, device="cuda", **options)
    x = torch.randn(m, 1024, dtype=dtype, device="cuda", requires_grad=True)
    y = layer(x)
    y.backward(torch.ones_like(y))
    error = ((y.double() - reference(layer, x.detach())).abs().max() / reference(layer, x.detach()).abs().max()).item()
    ok = error < 2e-2 and x.grad is not None and torch.isfinite(x.grad).all().item()
    print(f"{label:5} {str(dtype):15} m={m:5}  relative error {error:.2e}  {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    print(f"bundle: {env.kernel_bundles()}  cache: {env.cache_dir()} (writable: {os.access(env.cache_dir(), os.W_OK)})")
    results = [check(label, options, dtype, m) for label, options in CASES
               for dtype in (torch.bfloat16, torch.float16) for m in TOKENS]
    print(f"{sum(results)} of {len(results)} cases ran from the bundle alone")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
