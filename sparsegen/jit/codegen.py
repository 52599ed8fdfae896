"""Render a KernelSpec into CUDA C++ source. The only module that imports jinja2.

The template and what its context adds come from the op's layout (registry.OpRules);
here is only what every kernel's template may use: the spec's fields, flattened.
"""
from __future__ import annotations

import functools
from pathlib import Path

from . import epilogues, registry
from .spec import KernelSpec

MMA_TYPES = {"bf16": "Bf16", "fp16": "Fp16", "fp32": "Tf32", "int8": "Int8", "e4m3": "E4m3"}  # value conversions
_PTX_TYPE = {"bf16": "bf16", "fp16": "f16", "fp32": "tf32", "int8": "s8", "e4m3": "e4m3"}
ELEM_TYPES = {"bf16": "unsigned short", "fp16": "unsigned short", "fp32": "float", "int8": "signed char",
              "e4m3": "unsigned char"}


def templates_dir() -> Path:
    """Templates ship inside the wheel as sparsegen/templates; a checkout has them at top level."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"sparsegen templates not found in or next to {package}")


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2  # late: a process whose kernels are all cached never needs it

    # StrictUndefined: a template that names a variable we did not pass is an error,
    # never an empty string in generated code. No bytecode cache: jinja's is marshal'd code
    # it would run from a file, and a cached kernel's lookup (cache.alias_key) renders nothing.
    return jinja2.Environment(loader=jinja2.FileSystemLoader([str(root) for root in template_roots()]),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def template_roots() -> list[Path]:
    """The core's templates folder, then each plugin layout's (registry.Layout.templates): a
    template's path (OpRules.template) is found in the first that holds it."""
    plugins = [layout.templates for layout in registry.layouts() if layout.templates is not None]
    return [templates_dir(), *dict.fromkeys(Path(root) for root in plugins)]


def template_context(spec: KernelSpec) -> dict:
    """Everything a template may use: the spec's fields, flattened, plus derived names, plus
    what the op's layout adds (registry.OpRules.context). A run-time parameter (OpRules.
    run_params) renders as its own name: the kernel's argument of that name holds it."""
    t = spec.tile
    return dict(name=spec.name, op=spec.op, dtype=spec.dtype, arch=spec.arch, trans=spec.trans,
                bm=spec.block[0], bk=spec.block[1], mma=mma_type(spec), acc=spec.acc, elem=ELEM_TYPES[spec.dtype],
                tile_m=t.tile_m, warps_m=t.warps_m, warps_n=t.warps_n, stages=t.stages, cluster=t.cluster,
                threads=spec.threads, instr=spec.instr, ptx_type=_PTX_TYPE[spec.dtype], epilogue=spec.epilogue,
                epi=epilogues.device_struct(spec.epilogue), params=spec.param_values, **spec.param_values,
                run_params=[p.name for p in spec.rules.run_params], **{p.name: p.name for p in spec.rules.run_params},
                **spec.rules.context(spec))


def mma_type(spec: KernelSpec) -> str:
    """The sg_mma.cuh struct of the spec's operands and accumulator (Fp16, Fp16AccF16...)."""
    return MMA_TYPES[spec.dtype] + ("" if spec.acc == "f32" else f"Acc{spec.acc.upper()}")


def environment():
    return _environment()


def render(spec: KernelSpec) -> str:
    return environment().get_template(spec.rules.template).render(**template_context(spec))


def _template_files() -> list[Path]:
    """Every template and header (templates/<layout>/ and common/, and each plugin's folder),
    in a fixed order: the cache key covers a plugin's templates as it does the core's."""
    return [path for folder in template_roots() for pattern in ("*.j2", "*.cuh") for path in sorted(folder.rglob(pattern))]


def template_texts() -> list[str]:
    """Every template and header: what a rendered kernel can depend on."""
    return [p.read_text() for p in _template_files()]


# The core's Python that shapes a rendered kernel besides its spec: the templates' context.
_RENDERING_MODULES = ("codegen.py", "epilogues.py", "gathered_specs.py")


def generator_texts() -> list[str]:
    """template_texts() and the code that renders them - the core's and each layout's specs
    and format modules: what a kernel's source follows from, besides its spec (cache aliases
    and bundle manifests hash it)."""
    here = Path(__file__).resolve().parent
    layouts = [layout.package_dir / module for layout in registry.layouts() for module in ("specs.py", "format.py")]
    return template_texts() + [p.read_text() for p in [here / m for m in _RENDERING_MODULES] + layouts
                               if p.is_file()]


def headers() -> dict[str, str]:
    """Device headers handed to NVRTC by name, so no include path is needed (their names
    are unique across the layouts' folders)."""
    return {p.name: p.read_text() for root in template_roots() for p in sorted(root.rglob("*.cuh"))}
