"""Block-ELL weights: block-sparse with the same number of stored blocks in every block row.

The worked example of adding a layout (README, "Adding a layout"): the format and its CPU
reference (format), kernel specs with a parameter of their own (specs: rowblocks), which
kernel serves a call (dispatch), ops and the custom op (ops), autograd, the nn module (nn)
and the compiled-graph lowering (compiled). Templates: templates/bell/.
"""
