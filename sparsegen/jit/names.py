"""The kernel spec's vocabulary that needs no torch: dtypes, block sides and archs. The
`sparsegen` command validates its arguments with these before it imports anything heavier
(jit/spec.py, which re-exports them, checks whole specs)."""

DTYPES = ("fp16", "bf16", "fp32", "int8", "e4m3")
# One-byte inputs have only the 2:4 kernels (forward on k64 products, and pruning): int8
# (int32 out) from sm_80, fp8 e4m3 (bf16 out) from sm_89, the first arch with fp8 tensor cores.
BYTE_DTYPES = ("int8", "e4m3")
MIN_ARCH = {"e4m3": 89}
BLOCK_SIDES = (16, 32, 64, 128)
# Opt-in shared memory per block, by compute capability (CUDA programming guide).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
              100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024}
ARCHS = tuple(SMEM_LIMIT)
