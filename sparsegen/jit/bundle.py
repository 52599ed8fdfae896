"""Read-only bundles of precompiled kernels, to ship to machines that cannot compile.

`sparsegen precompile --arch sm_90 --bundle DIR` writes DIR/NAME.cubin for every kernel and
DIR/manifest.json: per kernel, its CUBIN's sha256, the digest of the source it was compiled
from (source_digest: the rendered kernel, the headers and NVRTC's options) and of what that
source followed from (origin_digest: the spec, every template and the rendering code), and
the NVRTC version that built them. SPARSEGEN_KERNEL_BUNDLE=DIR, or the installed
sparsegen_kernels package (tools/build_kernels.py; bundle.folders), makes cache.build
look there first: a first call then compiles nothing, and a machine with no NVRTC and no
writable home runs every kernel the bundle holds.

A kernel whose source today differs from its bundled one - an edited template, a plugin's
new header, a changed option - is passed over (and compiled), kernel by kernel: editing one
layout's template leaves the other layouts' bundled kernels in use, and never serves a
stale one. While nothing the kernels follow from has changed (the origin digests match), no
kernel is rendered to tell: a first call then costs no template compile either.

What is trusted: the manifest, read with json (never run), in a folder only its owner (the
user or root) can write; every CUBIN is checked against the manifest's hash before use.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import codegen, compiler, private_files, trust
from .. import env
from .diskstore import warn_once
from .spec import KernelSpec, fields_tuple
from ..errors import SparsegenError, expect

MANIFEST = "manifest.json"
FORMAT = "sparsegen-kernel-bundle/2"
_NAME_RE = re.compile(r"[a-z0-9_]{1,200}")  # KernelSpec.name's characters: a plain file name
_HASH_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Entry:
    cubin: str   # sha256 of NAME.cubin
    source: str  # source_digest of the kernel it was compiled from
    origin: str  # origin_digest: what that source was rendered from


@dataclass(frozen=True)
class Manifest:
    folder: Path
    nvrtc: str                   # the version that built them (for people: a CUBIN loads on any later driver)
    kernels: dict[str, Entry]


def source_digest(spec: KernelSpec) -> str:
    """sha256 of what NVRTC made the kernel from: its rendered source, the headers and the
    options (the cache key without NVRTC's version, which would load NVRTC to read)."""
    h = hashlib.sha256()
    for part in (codegen.render(spec), *codegen.headers().values(), *compiler.options(spec.target)):
        h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()


def origin_digest(spec: KernelSpec, generator_texts: list[str]) -> str:
    """sha256 of what the kernel's source follows from: its spec, the templates and the code
    that renders them (codegen.generator_texts), and NVRTC's options. Equal origins render
    equal sources; unequal ones may still (an edit elsewhere), which source_digest tells."""
    h = hashlib.sha256(repr(fields_tuple(spec)).encode())
    for part in (*generator_texts, *compiler.options(spec.target)):
        h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()


def lookup(spec: KernelSpec, origin: str) -> bytes | None:
    """The CUBIN of `spec` from the first bundle that holds it compiled from today's source,
    hash checked (origin: the spec's origin_digest, which the caller has for its alias)."""
    source = None
    for folder, named in _searched():
        manifest = _load(folder, named)
        entry = manifest.kernels.get(spec.name) if manifest is not None else None
        if entry is None:
            continue
        if entry.origin != origin:  # (something changed: render the kernel to see whether it did)
            source = source or source_digest(spec)
        cubin = _read_checked(manifest, spec.name) if entry.origin == origin or entry.source == source else None
        if cubin is not None:
            return cubin
    return None


def folders() -> list[Path]:
    """The bundles searched, in order: SPARSEGEN_KERNEL_BUNDLE's, then the installed
    sparsegen_kernels package's (one per arch folder that holds a manifest)."""
    return env.kernel_bundles() + [Path(folder) / name for folder in env.shipped_kernels_folders()
                                   for name in _arch_folders(str(folder))]


@functools.lru_cache(maxsize=8)
def _arch_folders(package_folder: str) -> tuple[str, ...]:
    try:
        names = private_files.list_names(Path(package_folder))
    except OSError:
        return ()
    return tuple(name for name in names if _holds_manifest(Path(package_folder) / name))


def summary() -> list[tuple[Path, int | None]]:
    """Each bundle searched, with how many kernels its manifest names (None: not loaded -
    untrusted, damaged or missing, with a warning saying which)."""
    loaded = [(Path(folder), _load(folder, named)) for folder, named in _searched()]
    return [(folder, len(manifest.kernels) if manifest is not None else None) for folder, manifest in loaded]


def _searched() -> list[tuple[str, bool]]:
    """folders(), absolute (not resolved: a link is judged as a link), each with whether the
    user named it (SPARSEGEN_KERNEL_BUNDLE) or it was found installed."""
    named = {os.path.abspath(folder) for folder in env.kernel_bundles()}
    return [(folder, folder in named) for folder in map(os.path.abspath, folders())]


def _holds_manifest(folder: Path) -> bool:
    try:
        return private_files.is_plain_file(folder / MANIFEST)
    except OSError:
        return False


@functools.lru_cache(maxsize=16)
def _load(folder: str, named: bool) -> Manifest | None:
    """The bundle's manifest if it is trusted and whole; None (one warning) otherwise. A bundle
    the user named (SPARSEGEN_KERNEL_BUNDLE) that others could have written is an error; an
    installed package's found on the path (perhaps through the working directory) is skipped."""
    path = Path(folder) / MANIFEST
    try:
        trust.check_path(Path(folder))
        return parse(Path(folder), trust.read_file(path))
    except (OSError, ValueError) as error:
        warn_once(("bundle", folder), f"ignoring the kernel bundle {folder} ({error})")
    except trust.UntrustedPathError as error:
        if named:
            raise
        warn_once(("bundle", folder), f"ignoring the installed kernels in {folder} ({error})")
    return None


def parse(folder: Path, raw: bytes) -> Manifest:
    """The manifest's fields, each checked (ValueError naming what is off)."""
    data = private_files.parse_json(raw)
    expect(isinstance(data, dict) and data.get("format") == FORMAT, f"a manifest of format {FORMAT}",
           repr(data.get("format") if isinstance(data, dict) else type(data).__name__), ValueError)
    kernels = data.get("kernels")
    expect(isinstance(kernels, dict), "'kernels' mapping names to their hashes", type(kernels).__name__, ValueError)
    nvrtc = data.get("nvrtc")
    expect(isinstance(nvrtc, str), "'nvrtc' naming a version", repr(nvrtc), ValueError)
    return Manifest(folder, nvrtc, {name: _entry(name, hashes) for name, hashes in kernels.items()})


def _entry(name, hashes) -> Entry:
    is_hash = lambda value: isinstance(value, str) and _HASH_RE.fullmatch(value) is not None  # noqa: E731
    expect(isinstance(name, str) and _NAME_RE.fullmatch(name) is not None and isinstance(hashes, dict)
           and set(hashes) == set(Entry.__dataclass_fields__) and all(map(is_hash, hashes.values())),
           "kernel names of [a-z0-9_], each with a 64-digit sha256 'cubin', 'source' and 'origin'",
           f"{name!r}: {hashes!r}", ValueError)
    return Entry(**hashes)


def _read_checked(manifest: Manifest, name: str) -> bytes | None:
    path = manifest.folder / f"{name}.cubin"
    try:  # (a regular file, not a link, a FIFO or a device, of a kernel's size at most)
        cubin = private_files.read_regular(path, trust.MAX_READ_BYTES)
    except OSError as error:
        warn_once(("bundle entry", str(path)), f"cannot read {path} ({error}); looking further")
        return None
    if hashlib.sha256(cubin).hexdigest() != manifest.kernels[name].cubin:
        warn_once(("bundle entry", str(path)), f"{path} does not match its manifest's sha256; ignoring it")
        return None
    return cubin


def _entry_of(spec: KernelSpec, cubin: bytes, generator_texts: list[str]) -> dict:
    return dict(cubin=hashlib.sha256(cubin).hexdigest(), source=source_digest(spec),
                origin=origin_digest(spec, generator_texts))


def is_free(folder: Path) -> bool:
    """Whether a bundle may be written there: a directory sparsegen creates now, or an empty
    one of the user's that no one else can write (nothing can have been planted in it, and
    nothing can be planted while the bundle is written)."""
    folder = Path(folder)
    try:
        if not os.path.lexists(folder):  # (the folders above it: no one else's, and the nearest one writable)
            trust.check_ancestors(folder)
            return os.access(trust.nearest_existing(folder), os.W_OK | os.X_OK)
        trust.check_path(folder)
    except (OSError, trust.UntrustedPathError):
        return False
    return not os.path.islink(folder) and not private_files.list_names(folder)



def write(folder: Path, cubins: dict[str, bytes]) -> Path:
    """Write a read-only bundle of `cubins` (kernel name -> CUBIN, compiled from today's
    source) into a new folder (or an empty private one): every file created exclusively
    without following links, its mode (0444) set on the open file, the folder's (0555) last."""
    folder = Path(folder)
    expect(is_free(folder), "a new directory for the bundle (or an empty one of yours that only you can write)",
           str(folder), SparsegenError)
    trust.make_parents(folder)  # (its parents: no one else can swap the folder away while it is written)
    if not os.path.lexists(folder):
        private_files.make_dir(folder, 0o700)
    for name in cubins:
        expect(_NAME_RE.fullmatch(name) is not None, "kernel names of [a-z0-9_]", repr(name), SparsegenError)
    texts = codegen.generator_texts()
    kernels = {name: _entry_of(KernelSpec.from_name(name), cubin, texts) for name, cubin in sorted(cubins.items())}
    for name, cubin in cubins.items():
        private_files.create_file(folder, f"{name}.cubin", cubin, 0o444)
    manifest = dict(format=FORMAT, nvrtc=compiler.nvrtc_version(), kernels=kernels)
    private_files.create_file(folder, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), 0o444)
    private_files.set_dir_mode(folder, 0o555)
    return folder / MANIFEST
