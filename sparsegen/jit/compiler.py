"""NVRTC: CUDA C++ source + arch -> CUBIN. Never PTX: a CUBIN from a newer NVRTC still
loads on an older driver, PTX does not."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from .. import env
from . import private_files, trust
from .diskstore import warn_once
from ..errors import CompileError, SparsegenError

BASE_OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization")


def _nvrtc():
    from cuda.bindings import nvrtc  # imported late: `import sparsegen` stays fast

    return nvrtc


def _check(result, what: str):
    status, *values = result
    if int(status) != 0:
        raise SparsegenError(f"NVRTC {what} failed: {status!r}")
    return values[0] if len(values) == 1 else values


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    major, minor = _check(_nvrtc().nvrtcVersion(), "version query")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def identity() -> tuple[str, ...]:
    """What identifies the installed compiler stack, read from file metadata without loading
    NVRTC or scanning every installed distribution (each costs tens of ms in a new process):
    the cuda.bindings and jinja2 modules, and the NVRTC libraries of the nvidia wheels."""
    marks = [_file_mark(module) for module in ("cuda.bindings", "jinja2")]
    nvidia = importlib.util.find_spec("nvidia")
    for folder in (nvidia.submodule_search_locations if nvidia else []):
        marks += sorted(f"{p.name}:{p.stat().st_size}" for p in Path(folder).glob("*/lib/libnvrtc.so*"))
    return tuple(marks)


def _file_mark(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return f"{module}:absent"
    stat = Path(spec.origin).stat()
    return f"{module}:{stat.st_size}:{stat.st_mtime_ns}"


def options(target: str) -> tuple[str, ...]:
    """target: NVRTC's architecture name, e.g. sm_80 or sm_90a."""
    return (f"--gpu-architecture={target}",) + BASE_OPTIONS


def compile_cubin(source: str, name: str, target: str, headers: dict[str, str]) -> bytes:
    """Compile to CUBIN or raise CompileError with NVRTC's log and the dumped source path."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(
        source.encode(), f"{name}.cu".encode(), len(headers),
        [h.encode() for h in headers.values()], [n.encode() for n in headers]), "create")
    try:
        opts = [o.encode() for o in options(target)]
        status, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(status) != 0:
            raise CompileError(name, _log(prog), str(dump_source(name, source, headers)))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "CUBIN size")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "CUBIN read")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(prog) -> str:
    nvrtc = _nvrtc()
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
    log = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, log), "log read")
    return log.rstrip(b"\x00 ").decode(errors="replace")


def dump_source(name: str, source: str, headers: dict[str, str]) -> Path:
    """Write the generated source (and the headers it includes) where a human can read it:
    a new private folder (mkdtemp: 0700, a fresh name) inside the dump directory, each file
    created exclusively. A dump directory someone else could write (a shared folder) is
    passed over for the system's temporary directory, and the message says where it went."""
    folder = private_files.make_temp_dir(f"{name}-", _dump_root())
    for header, text in headers.items():
        private_files.create_file(folder, Path(header).name, text.encode(), trust.PRIVATE_FILE_MODE)
    return private_files.create_file(folder, f"{name}.cu", source.encode(), trust.PRIVATE_FILE_MODE)


def _dump_root() -> Path | None:
    """SPARSEGEN_DUMP_DIR (or the cache's failed/) if only the user can write it; else None."""
    try:
        trust.make_dirs(env.dump_dir())
        return env.dump_dir()
    except (OSError, trust.UntrustedPathError) as error:
        warn_once(("dump", str(env.dump_dir())), f"not writing generated sources into {env.dump_dir()} ({error}); "
                                                 "using the system's temporary directory")
        return None
