"""Render a KernelSpec into CUDA C++ source. The only module that imports jinja2."""
from __future__ import annotations

import functools
from pathlib import Path

from . import epilogues
from .layouts.semi24 import ROW_PAIRS, TRANSPOSABLE_PATTERNS
from .spec import BYTE_DTYPES, KernelSpec

_MMA = {"bf16": "Bf16", "fp16": "Fp16", "fp32": "Tf32", "int8": "Int8", "e4m3": "E4m3"}  # value conversions
_PTX_TYPE = {"bf16": "bf16", "fp16": "f16", "fp32": "tf32", "int8": "s8", "e4m3": "e4m3"}
_ELEM = {"bf16": "unsigned short", "fp16": "unsigned short", "fp32": "float", "int8": "signed char",
         "e4m3": "unsigned char"}


def _output_context(dtype: str) -> dict:
    """The 2:4 forward's accumulator and Y: int8 sums stay int32 (exact, s32 accumulators);
    everything else accumulates in f32 and is written in its own type, e4m3 as bf16."""
    one_byte, integer = dtype in BYTE_DTYPES, dtype == "int8"  # one-byte values: raw bytes to the pruning kernels
    out = "bf16" if one_byte else dtype  # Y's type, int8's int32 aside (its out_mma then unused)
    out_mma = _MMA[out]
    # wgmma.sp's trailing immediates: scale-a/b and transposes (16-bit), scales (fp8), none (int8)
    immediates = ", 1, 1, 0, 0" if not one_byte else "" if integer else ", 1, 1"
    return dict(out_policy="Int32Out" if integer else f"FloatOut<sg::{out_mma}>",
                out_elem="int" if integer else _ELEM[out],
                acc="int" if integer else "float", acc_ptx="s32" if integer else "f32", acc_reg="r" if integer else "f",
                sp_k=64 if one_byte else 32, one_byte=one_byte, out_mma=out_mma, wgmma_immediates=immediates)


def templates_dir() -> Path:
    """Templates ship inside the wheel as sparsegen/templates; a checkout has them at top level."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"sparsegen templates not found next to {here}")


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2  # late: a process whose kernels are all cached never needs it

    # StrictUndefined: a template that names a variable we did not pass is an error,
    # never an empty string in generated code. No bytecode cache: jinja's is marshal'd code
    # it would run from a file, and a cached kernel's lookup (cache.alias_key) renders nothing.
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def template_context(spec: KernelSpec) -> dict:
    """Everything a template may use: the spec's fields, flattened, plus derived names."""
    t = spec.tile
    return dict(name=spec.name, op=spec.op, dtype=spec.dtype, arch=spec.arch, trans=spec.trans,
                bm=spec.block[0], bk=spec.block[1], mma=_MMA[spec.dtype], elem=_ELEM[spec.dtype],
                tile_m=t.tile_m, warps_m=t.warps_m, warps_n=t.warps_n, stages=t.stages, cluster=t.cluster,
                threads=spec.threads, instr=spec.instr, ptx_type=_PTX_TYPE[spec.dtype],
                pairs=ROW_PAIRS, patterns=TRANSPOSABLE_PATTERNS, epilogue=spec.epilogue,
                epi=epilogues.device_struct(spec.epilogue), **_output_context(spec.dtype))


def environment():
    return _environment()


def render(spec: KernelSpec) -> str:
    return environment().get_template(f"{spec.op}.cu.j2").render(**template_context(spec))


def template_texts() -> list[str]:
    """Every template and header, in a fixed order: what a rendered kernel can depend on."""
    folder = templates_dir()
    return [p.read_text() for p in sorted(folder.glob("*.j2")) + sorted(folder.glob("*.cuh"))]


# The Python that shapes a rendered kernel besides its spec: the templates' context.
_RENDERING_MODULES = ("codegen.py", "epilogues.py", "layouts/semi24.py")


def generator_texts() -> list[str]:
    """template_texts() and the code that renders them: what a kernel's source follows from,
    besides its spec (cache aliases and bundle manifests hash it)."""
    here = Path(__file__).resolve().parent
    return template_texts() + [(here / module).read_text() for module in _RENDERING_MODULES]


def headers() -> dict[str, str]:
    """Device headers handed to NVRTC by name, so no include path is needed."""
    return {p.name: p.read_text() for p in sorted(templates_dir().glob("*.cuh"))}
