"""Block-diagonal weights (Monarch-style): W is `nblocks` dense blocks on its diagonal.

A layout through the layout kit (gathered_specs.py, gathered.py) that keeps no index: a
block's column is arithmetic (templates/bdiag/). Its transpose is block-diagonal too, so
dX is the same kernel over the transposed blocks, and dW a batched product (the kit's
`transposed` and `weight_grad` hooks, ops.py).
"""
