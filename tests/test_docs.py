"""The README and docs/ are code: every Python block runs here, verbatim, in a fresh
interpreter on the checkout's library (a block tagged `python gpu` runs where a GPU is; one
tagged `python checkpoint` gets `path`, a small llm-compressor-format checkpoint; blocks whose
tag is a file path are the layout tutorial's, which tests/test_tutorial.py builds). The error
and environment tables name every exported error and every variable sparsegen reads, and
every link between the documents leads somewhere."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsegen
from sparsegen import errors

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def python_blocks():
    for document in DOCUMENTS:
        text = document.read_text()
        for match in BLOCK.finditer(text):
            tag = match.group(1).strip()
            if "/" in tag:
                continue  # (a tutorial file, written out by tests/test_tutorial.py)
            line = text[:match.start()].count("\n") + 1
            marks = [pytest.mark.gpu] if tag == "gpu" else []
            yield pytest.param(tag, match.group(2), id=f"{document.relative_to(ROOT)}:{line}", marks=marks)


BLOCKS = list(python_blocks())


def test_the_readme_is_short_and_every_document_has_blocks_to_run():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("tag, code", BLOCKS)
def test_every_python_block_runs_verbatim(tag, code, tmp_path):
    if tag == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    prelude = ""
    if tag == "checkpoint":
        from test_compressed import checkpoint
        (tmp_path / "ckpt").mkdir()
        prelude = f"path = {str(checkpoint(tmp_path / 'ckpt', 'bf16'))!r}\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SPARSEGEN_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", prelude + code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def exported_errors() -> set[str]:
    return {name for name in dir(sparsegen) if isinstance(getattr(sparsegen, name), type)
            and issubclass(getattr(sparsegen, name), errors.SparsegenError)}


def test_the_error_table_names_every_error_and_each_is_exported():
    defined = {name for name, value in vars(errors).items() if isinstance(value, type)
               and issubclass(value, errors.SparsegenError) and name != "SparsegenError"}
    table = (ROOT / "docs" / "errors-and-environment.md").read_text()
    assert defined | {"UntrustedPathError"} <= exported_errors()
    for name in exported_errors() - {"SparsegenError"}:
        assert f"| `{name}` |" in table, name


def test_the_environment_table_names_every_variable_sparsegen_reads():
    read = {name for path in (ROOT / "sparsegen").rglob("*.py")
            for name in re.findall(r"SPARSEGEN_[A-Z_]+[A-Z]", path.read_text())}
    table = (ROOT / "docs" / "errors-and-environment.md").read_text()
    assert read and all(f"`{name}" in table for name in read), read


def test_every_link_between_the_documents_leads_to_a_file():
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", document.read_text()):
            assert (document.parent / target).exists(), (document.name, target)
