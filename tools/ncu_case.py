"""One forward of one configuration, for Nsight Compute:
ncu --clock-control none -k regex:bsr_dds -s 3 -c 1 python tools/ncu_case.py M K N BLOCK DENSITY"""
import sys

import torch

import sparsegen

m, k, n, block = (int(v) for v in sys.argv[1:5])
density = float(sys.argv[5])
layer = sparsegen.linear(k, n, block=(block, block), density=density, bias=False, device="cuda",
                         dtype=torch.bfloat16)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    for _ in range(5):
        layer(x)
torch.cuda.synchronize()
