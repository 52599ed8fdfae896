"""One forward of one configuration, for Nsight Compute:
ncu --clock-control none -k regex:bsr_dds -s 3 -c 1 python tools/ncu_case.py M K N BLOCK DENSITY
BLOCK "int4": a 4-bit 2:4 layer (DENSITY then its group size): -k regex:sp24_w4"""
import sys

import torch

import sparsegen

m, k, n = (int(v) for v in sys.argv[1:4])
kind, amount = sys.argv[4], float(sys.argv[5])
if kind == "int4":
    layer = sparsegen.linear(k, n, sparsity="2:4", weight_dtype="int4", group_size=int(amount), bias=False,
                             device="cuda", dtype=torch.bfloat16)
else:
    layer = sparsegen.linear(k, n, block=(int(kind), int(kind)), density=amount, bias=False, device="cuda",
                             dtype=torch.bfloat16)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    for _ in range(5):
        layer(x)
torch.cuda.synchronize()
