"""Build the sparsegen-kernels wheel: every standard kernel, precompiled for each arch, as the
package `sparsegen_kernels` (one read-only bundle per arch, sparsegen/jit/bundle.py). Installed
next to sparsegen, a first call loads its kernels instead of compiling them (a cold patch +
first forward then costs about what dense's does); a kernel whose template was edited since is
passed over and compiled, kernel by kernel. No GPU needed.

    python tools/build_kernels.py --out dist/                  # sm_80, sm_89 and sm_90
    python tools/build_kernels.py --out dist/ --arch sm_90 --layout semi24 --dtype bf16
    pip install dist/sparsegen_kernels-*.whl

Other arguments (--layout, --dtype, --block, -j) pass to `sparsegen precompile`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from sparsegen import __version__, env  # noqa: E402 (the checkout's: torch-free, see sparsegen/__init__.py)

DEFAULT_ARCHS = ("sm_80", "sm_89", "sm_90")
PACKAGE = env.SHIPPED_KERNELS_PACKAGE

PYPROJECT = """[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "sparsegen-kernels"
version = "{version}"
description = "sparsegen's standard kernels, precompiled (CUBIN) for {archs}"
requires-python = ">=3.10"

[tool.setuptools]
packages = ["{package}"]
include-package-data = false

[tool.setuptools.package-data]
{package} = ["*/manifest.json", "*/*.cubin"]
"""


def precompile(arch: str, into: Path, passed: list[str]) -> None:
    """`sparsegen precompile --arch ARCH --bundle INTO` with the checkout's sparsegen."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, "-m", "sparsegen", "precompile", "--arch", arch, *passed, "--bundle", str(into)],
                   env=environ, check=True)


def write_project(root: Path, archs: list[str]) -> None:
    (root / "pyproject.toml").write_text(PYPROJECT.format(version=__version__, archs=", ".join(archs), package=PACKAGE))
    (root / PACKAGE / "__init__.py").write_text('"""Precompiled sparsegen kernels: data only, read by '
                                                'sparsegen (its jit.bundle.folders), never imported by it."""\n')


def check_setuptools() -> None:
    """The wheel is built offline with this environment's setuptools (77 reads the SPDX
    fields): say so before minutes of compiling, not after."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("setuptools")
    except PackageNotFoundError:
        found = "none"
    if found == "none" or int(found.split(".")[0]) < 77:
        sys.exit(f"Expected setuptools>=77 in this environment (pip install 'setuptools>=77'). Got {found}.")


def build_wheel(root: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(root)], check=True, stdout=subprocess.DEVNULL)
    return max(out.glob("sparsegen_kernels-*.whl"), key=lambda p: p.stat().st_mtime)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder the wheel is written into")
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS))
    args, passed = parser.parse_known_args(argv)
    check_setuptools()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "project"
        (root / PACKAGE).mkdir(parents=True)
        try:
            for arch in args.arch:
                precompile(arch, root / PACKAGE / arch, passed)
            write_project(root, args.arch)
            wheel = build_wheel(root, args.out)
        finally:  # (the bundles are read-only folders: make them removable)
            for folder in (root / PACKAGE).glob("*/"):
                folder.chmod(0o755)
    print(f"{wheel} ({wheel.stat().st_size / 2**20:.1f} MiB): pip install it next to sparsegen")
    return 0


if __name__ == "__main__":
    sys.exit(main())
