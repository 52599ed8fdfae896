"""What runs kernels: loading a cubin and launching it (runtime), per-call launch plans
(plans), the layers' lean calls (lean), workspaces, the work done outside CUDA graphs
(outside_graphs), the dense path and where it pays (dense_path, crossovers), the custom ops
(library) and the calls every layer makes (calls). It builds on jit/; no layout lives here."""
