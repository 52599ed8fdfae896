"""2:4 semi-structured weights: the format and its CPU reference (format), kernel specs
(specs), which kernel serves a call (dispatch), ops, autograd, Sparse24Tensor (tensor), the
nn modules (nn) and the 2:4 training recipe (train). Templates: templates/semi24/."""
