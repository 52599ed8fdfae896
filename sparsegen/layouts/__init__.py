"""One module per sparsity format."""
