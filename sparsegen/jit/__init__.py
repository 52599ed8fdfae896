"""What makes kernels, in pipeline order: a KernelSpec (spec) is checked by its layout's rules
(registry, gathered_specs for the fixed-rows kit, epilogues), rendered from a template
(codegen), compiled by NVRTC (compiler) and kept on disk (cache, its storage diskstore, the
ownership checks in trust, and prebuilt bundles). Nothing here launches a kernel or imports
torch's CUDA runtime; it imports only the package's errors and env."""
