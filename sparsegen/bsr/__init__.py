"""Block-sparse (block-CSR) weights: the format and its CPU reference (format), kernel specs
(specs), which kernel serves a call (dispatch), ops and custom ops (ops), autograd, the
nn modules (nn) and topology updates (topology). Templates: templates/bsr/."""
