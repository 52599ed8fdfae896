"""Read-only bundles of precompiled kernels, to ship to machines that cannot compile.

`sparsegen precompile --arch sm_90 --bundle DIR` writes DIR/NAME.cubin for every kernel and
DIR/manifest.json: each CUBIN's sha256, the NVRTC version that built them, and a digest of
the templates and rendering code (codegen.generator_texts). SPARSEGEN_KERNEL_BUNDLE=DIR
makes cache.build look there first; a machine with no NVRTC and no writable home then
runs every kernel the bundle holds.

What is trusted: the manifest, read with json (never run), in a folder only its owner (the
user or root) can write; every CUBIN is checked against the manifest's hash before use. A
bundle built from other templates is skipped with a warning (its kernels would be stale).
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
from ..errors import SparsegenError, expect

MANIFEST = "manifest.json"
FORMAT = "sparsegen-kernel-bundle/1"
_NAME_RE = re.compile(r"[a-z0-9_]{1,200}")  # KernelSpec.name's characters: a plain file name
_HASH_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Manifest:
    folder: Path
    nvrtc: str
    generator: str               # sha256 of codegen.generator_texts() when it was built
    kernels: dict[str, str]      # kernel name -> sha256 of NAME.cubin


def generator_digest(generator_texts: list[str] | None = None) -> str:
    """sha256 over codegen.generator_texts() (or those texts, already read by the caller)."""
    h = hashlib.sha256()
    for text in generator_texts if generator_texts is not None else codegen.generator_texts():
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()


def lookup(name: str, generator_texts: list[str]) -> bytes | None:
    """The CUBIN of kernel `name` from the first bundle that holds it, hash checked; bundles
    built from other generator texts than these are skipped."""
    folders = env.kernel_bundles()
    current = generator_digest(generator_texts) if folders else None
    for folder in folders:
        manifest = _load(os.path.abspath(folder), current)  # (not resolved: a link is judged as a link)
        if manifest is not None and name in manifest.kernels:
            cubin = _read_checked(manifest, name)
            if cubin is not None:
                return cubin
    return None


@functools.lru_cache(maxsize=16)
def _load(folder: str, current_generator: str) -> Manifest | None:
    """The bundle's manifest if it is trusted, whole and current; None (one warning) otherwise."""
    path = Path(folder) / MANIFEST
    try:
        trust.check_path(Path(folder))
        manifest = parse(Path(folder), trust.read_file(path))
    except (OSError, ValueError) as error:
        warn_once(("bundle", folder), f"ignoring the kernel bundle {folder} ({error})")
        return None
    if manifest.generator != current_generator:
        warn_once(("bundle", folder), f"ignoring the kernel bundle {folder}: it was built from other "
                                      "templates than this sparsegen's; precompile it again")
        return None
    return manifest


def parse(folder: Path, raw: bytes) -> Manifest:
    """The manifest's fields, each checked (ValueError naming what is off)."""
    data = private_files.parse_json(raw)
    expect(isinstance(data, dict) and data.get("format") == FORMAT, f"a manifest of format {FORMAT}",
           repr(data.get("format") if isinstance(data, dict) else type(data).__name__), ValueError)
    kernels = data.get("kernels")
    expect(isinstance(kernels, dict), "'kernels' mapping names to sha256 hashes", type(kernels).__name__, ValueError)
    for name, digest in kernels.items():
        expect(_NAME_RE.fullmatch(name) is not None and isinstance(digest, str) and _HASH_RE.fullmatch(digest),
               "kernel names of [a-z0-9_] and 64-digit sha256 hashes", f"{name!r}: {digest!r}", ValueError)
    nvrtc, generator = data.get("nvrtc"), data.get("generator")
    expect(isinstance(nvrtc, str) and isinstance(generator, str) and _HASH_RE.fullmatch(generator),
           "'nvrtc' and a sha256 'generator'", f"{nvrtc!r}, {generator!r}", ValueError)
    return Manifest(folder, nvrtc, generator, dict(kernels))


def _read_checked(manifest: Manifest, name: str) -> bytes | None:
    path = manifest.folder / f"{name}.cubin"
    try:  # (a regular file, not a link, a FIFO or a device, of a kernel's size at most)
        cubin = private_files.read_regular(path, trust.MAX_READ_BYTES)
    except OSError as error:
        warn_once(("bundle entry", str(path)), f"cannot read {path} ({error}); looking further")
        return None
    if hashlib.sha256(cubin).hexdigest() != manifest.kernels[name]:
        warn_once(("bundle entry", str(path)), f"{path} does not match its manifest's sha256; ignoring it")
        return None
    return cubin


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
    """Write a read-only bundle of `cubins` (kernel name -> CUBIN) into a new folder (or an
    empty private one): every file created exclusively without following links, its mode
    (0444) set on the open file, the folder's (0555) last."""
    folder = Path(folder)
    expect(is_free(folder), "a new directory for the bundle (or an empty one of yours that only you can write)",
           str(folder), SparsegenError)
    trust.make_parents(folder)  # (its parents: no one else can swap the folder away while it is written)
    if not os.path.lexists(folder):
        private_files.make_dir(folder, 0o700)
    for name, cubin in cubins.items():
        expect(_NAME_RE.fullmatch(name) is not None, "kernel names of [a-z0-9_]", repr(name), SparsegenError)
        private_files.create_file(folder, f"{name}.cubin", cubin, 0o444)
    manifest = dict(format=FORMAT, nvrtc=compiler.nvrtc_version(), generator=generator_digest(),
                    kernels={name: hashlib.sha256(c).hexdigest() for name, c in sorted(cubins.items())})
    private_files.create_file(folder, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode(), 0o444)
    private_files.set_dir_mode(folder, 0o555)
    return folder / MANIFEST
