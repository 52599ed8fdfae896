"""The `sparsegen` command: precompile kernels, inspect the disk cache, show generated source,
measure this GPU's crossovers (tune).

Every bad input ends as one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import __version__, env
from .jit import names, trust
from .errors import ConfigError, InputError, SparsegenError, SpecError, expect

# torch, the kernel specs and the cache are imported by the commands that use them: --help,
# --version and a bad command line answer without torch's seconds of import.

USAGE_ERROR = 2  # what argparse itself returns for a bad command line
_ARCH_RE = re.compile(r"(?:sm_?)?(\d+)a?", re.IGNORECASE)  # sm_90a: same specs as sm_90
_BLOCK_RE = re.compile(r"(\d+)(?:x(\d+))?")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (SpecError, InputError, ConfigError, trust.UntrustedPathError) as error:  # (the user's to fix)
        return _fail(error, USAGE_ERROR)
    except SparsegenError as error:  # e.g. NVRTC rejected a template: not the user's input
        return _fail(error, 1)
    except KeyboardInterrupt:
        return 130


def _fail(error: Exception, code: int) -> int:
    print(f"sparsegen: error: {error}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsegen", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--version", action="version", version=f"sparsegen {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_precompile(commands)
    _add_cache(commands)
    _add_show(commands)
    _add_tune(commands)
    return parser


def _selection_options() -> argparse.ArgumentParser:
    """--arch/--dtype/--block, shared by precompile and show --list."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--arch", help="sm_80, 80, sm_90, ... (default: this machine's GPU)")
    options.add_argument("--dtype", nargs="+", metavar="DTYPE",
                         help=f"any of {' '.join(names.DTYPES)} (default: all the arch supports; "
                              "one-byte types get 2:4 kernels only)")
    options.add_argument("--block", nargs="+", metavar="BLOCK",
                         help="block shapes: 32 (square) or 32x64 (default: the standard set)")
    options.add_argument("--layout", nargs="+", metavar="LAYOUT",
                         help="only these layouts' kernels: bsr, semi24, bell, bdiag or a plugin's (`show --layouts` lists "
                              "them; default: every layout)")
    return options


def _add_precompile(commands) -> None:
    sub = commands.add_parser("precompile", parents=[_selection_options()],
                              help="compile the default kernels into the disk cache")
    sub.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                     help="parallel compiles (default: one per core)")
    sub.add_argument("--bundle", type=Path, metavar="DIR",
                     help="also write the kernels into DIR (new, or empty and private) as a read-only bundle that "
                          "SPARSEGEN_KERNEL_BUNDLE=DIR loads on machines without NVRTC")
    sub.set_defaults(run=cmd_precompile)


def _add_cache(commands) -> None:
    sub = commands.add_parser("cache", help="inspect or empty the disk cache")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("info", help="directory, entries, bytes").set_defaults(run=cmd_cache_info)
    actions.add_parser("clear", help="remove every entry").set_defaults(run=cmd_cache_clear)
    actions.add_parser("list", help="each entry's kernel, read from the entry: key, name, layout").set_defaults(
        run=cmd_cache_list)


def _add_show(commands) -> None:
    sub = commands.add_parser("show", parents=[_selection_options()],
                              help="print a kernel's generated CUDA source, or list kernel names")
    which = sub.add_mutually_exclusive_group(required=True)
    which.add_argument("name", nargs="?", metavar="NAME", help="a kernel name, as --list prints")
    which.add_argument("--list", action="store_true", help="list the default kernel names")
    which.add_argument("--layouts", action="store_true",
                       help="list the layouts: the shipped ones and the plugins that loaded, and any that did not")
    sub.add_argument("--no-compile", action="store_true",
                     help="only render (by default NAME is also compiled; a failure prints the NVRTC log)")
    sub.set_defaults(run=cmd_show)


# --- parsing the selection -------------------------------------------------------------------

def _add_tune(commands) -> None:
    sub = commands.add_parser("tune", help="measure where this GPU's sparse kernels beat cuBLAS (times every layout's kernels at many shapes)")
    sub.add_argument("--quick", action="store_true", help="a smaller grid (a few seconds)")
    sub.add_argument("--out", type=Path, help="table file (default: this GPU's, in the cache directory)")
    sub.add_argument("--layout", action="append",
                     help="measure this layout only (sp24, bsr, bell, bdiag; repeatable); the others' points are kept")
    sub.set_defaults(run=cmd_tune)


def cmd_tune(args) -> int:
    from . import tune  # imports the layers (and torch's CUDA state) only when asked
    return tune.main(args.quick, args.out, args.layout)


def parse_arch(text: str) -> int:
    """'sm_80', 'sm80' or '80' -> 80, if some template supports that arch."""
    match = _ARCH_RE.fullmatch(text.strip())
    arch = int(match.group(1)) if match else None
    supported = ", ".join(f"sm_{a}" for a in names.ARCHS)
    expect(arch in names.ARCHS, f"--arch one of {supported}", repr(text), SpecError)
    return arch


def parse_block(text: str) -> tuple[int, int]:
    """'32' -> (32, 32); '32x64' -> (32, 64). KernelSpec checks the sides themselves."""
    match = _BLOCK_RE.fullmatch(text.strip().lower())
    expect(match is not None, "--block like 32 or 32x64", repr(text), SpecError)
    rows = int(match.group(1))
    return rows, int(match.group(2) or rows)


def local_arch() -> int:
    """The arch of this machine's GPU (the only step that needs one)."""
    import torch

    if not torch.cuda.is_available():
        raise SpecError("no CUDA GPU here to detect the arch from; pass --arch, e.g. --arch sm_80")
    major, minor = torch.cuda.get_device_capability()
    return parse_arch(f"{major}{minor}")


def check_selection(args) -> None:
    """--arch and --block as parse_arch and parse_block take them, before anything imports torch."""
    if args.arch:
        parse_arch(args.arch)
    for block in args.block or []:
        parse_block(block)


def selected_specs(args) -> tuple[int, list]:
    from .jit import spec as specs

    arch = parse_arch(args.arch) if args.arch else local_arch()
    dtypes = list(dict.fromkeys(args.dtype)) if args.dtype else None
    blocks = list(dict.fromkeys(map(parse_block, args.block))) if args.block else None
    layouts = list(dict.fromkeys(args.layout)) if args.layout else None
    return arch, list(dict.fromkeys(specs.default_specs(arch, dtypes, blocks, layouts)))  # no repeats


# --- commands ----------------------------------------------------------------------------------

def cmd_precompile(args) -> int:
    expect(args.jobs >= 1, "--jobs at least 1", args.jobs, SpecError)
    check_selection(args)
    from .jit import bundle

    if args.bundle is not None:  # before minutes of compiling, not after
        expect(bundle.is_free(args.bundle), "--bundle naming a new directory (or an empty one of yours that only you "
               "can write)", str(args.bundle), SpecError)
    arch, todo = selected_specs(args)
    start = time.perf_counter()
    builds = _build_all(todo, args.jobs, f"precompile sm_{arch}")
    compiled = sum(b.compiled for b in builds)
    print(f"precompile sm_{arch}: {len(todo)} kernels, {compiled} compiled, "
          f"{len(todo) - compiled} cached, {time.perf_counter() - start:.1f} s")
    if args.bundle is not None:
        try:
            manifest = bundle.write(args.bundle, {b.spec.name: b.cubin for b in builds})
        except OSError as error:  # (changed since the check above: the kernels stay in the cache)
            raise SparsegenError(f"Expected to write the bundle into {args.bundle}. Got {error}; the kernels are "
                                 "in the cache: run precompile again with another --bundle.") from None
        print(f"bundle: {len(builds)} kernels in {args.bundle} (manifest {manifest.name}); "
              f"load it with SPARSEGEN_KERNEL_BUNDLE={args.bundle}")
    return 0


def _build_all(todo: list, jobs: int, label: str) -> list:
    """Build every spec (cache.Built each) under a progress bar."""
    from tqdm import tqdm

    builds = []
    with tqdm(total=len(todo), desc=label, unit="kernel", file=sys.stderr) as bar:
        for built in _builds(todo, jobs):
            builds.append(built)
            bar.update()
    return builds


def _builds(todo: list, jobs: int):
    """Yield builds as they finish, here or in a pool (the cache locks per key)."""
    from .jit import cache

    if jobs == 1 or len(todo) <= 1:
        yield from map(cache.build, todo)
        return
    with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=_pool_context()) as pool:
        settings = {name: value for name, value in os.environ.items() if name.startswith("SPARSEGEN_")}
        futures = [pool.submit(_build_in_worker, spec, settings) for spec in todo]
        try:
            yield from (future.result() for future in as_completed(futures))
        finally:
            for future in futures:  # after a failure, start no more compiles
                future.cancel()


def _pool_context():
    """forkserver: workers fork from a clean process that imported the cache (and so torch)
    once; plain fork could copy a CUDA context (local_arch) or tqdm's thread into them."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["sparsegen.jit.cache"])
    return context


def _build_in_worker(spec, settings: dict | None = None):
    """cache.build in a pool's worker, under the caller's SPARSEGEN_* `settings` (a forkserver
    started earlier in the process keeps the environment it had then: the cache folder too)."""
    if settings is not None:
        for name in [name for name in os.environ if name.startswith("SPARSEGEN_")]:
            del os.environ[name]
        os.environ.update(settings)
    from .jit import cache

    try:
        return cache.build(spec)
    except SparsegenError as error:
        # CompileError's __init__ takes three arguments, so it cannot be unpickled in the
        # parent; its message (with NVRTC's log) is what the user needs.
        raise SparsegenError(str(error)) from None


def _print_layouts() -> int:
    """Each layout and where it comes from; each plugin that failed, with its error (exit 1)."""
    from .jit import registry

    for layout in registry.layouts():
        origin = f"plugin {layout.package}" if layout.package else "shipped"
        print(f"{layout.name}: {origin} ({', '.join(rules.op for rules in layout.ops)})")
    failed = registry.failed_plugins()
    for name, error in failed.items():
        print(f"{name}: plugin not loaded - {error}")
    return 1 if failed else 0


def cmd_cache_info(args) -> int:
    from .jit import bundle, cache

    for field, value in cache.info().items():
        print(f"{field}: {value}")
    for folder, kernels in bundle.summary():  # (searched first: SPARSEGEN_KERNEL_BUNDLE, the kernels package)
        print(f"bundle: {folder} ({kernels if kernels is not None else 'not loaded: see the warning'} kernels)")
    return 0


def cmd_cache_list(args) -> int:
    from .jit import cache, registry

    for key, spec in cache.entries():
        named = "(damaged, or names no kernel)" if spec is None else f"{spec.name}  layout {registry.layout_of(spec.op)}"
        print(f"{key[:16]}  {named}")
    return 0


def cmd_cache_clear(args) -> int:
    from .jit import cache

    removed, left = cache.clear()
    print(f"removed {removed} entries from {env.cache_dir()}")
    if left:
        print(f"left {len(left)} paths sparsegen did not write: {', '.join(left[:10])}"
              + (f" and {len(left) - 10} more" if len(left) > 10 else ""))
    return 0


def cmd_show(args) -> int:
    check_selection(args)
    from .jit import cache, codegen, spec as specs

    if args.layouts:
        return _print_layouts()
    if args.list:
        print("\n".join(spec.name for spec in selected_specs(args)[1]))
        return 0
    spec = specs.KernelSpec.from_name(args.name)
    print(codegen.render(spec), end="")
    if not args.no_compile:  # a template that renders may still not compile: NVRTC says why (exit 1)
        built = cache.build(spec)
        print(f"sparsegen: {spec.name} compiled for {spec.target}: {len(built.cubin)} bytes of CUBIN "
              f"({'compiled now' if built.compiled else 'from the cache'})", file=sys.stderr)
    return 0
