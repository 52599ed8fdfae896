"""The skip guard (tests/skip_guard.py): only a missing GPU may skip a test."""
import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).parent

CASES = '''
import pytest

def test_needs_gpu():
    pytest.skip("needs a CUDA GPU")

def test_needs_two():
    pytest.skip("needs 2 GPUs")

def test_needs_hopper():
    pytest.skip("wgmma.sp kernels are sm_90 only")

def test_other_reason():
    pytest.skip("this data file is not here")

@pytest.mark.skipif(True, reason="needs root")
def test_marked():
    pass

def test_passes():
    pass
'''


def _run(tmp_path, files: dict) -> str:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "skip_guard", "-p", "no:cacheprovider", "-rA",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def test_only_a_missing_gpu_may_skip(tmp_path):
    out = _run(tmp_path, {"test_cases.py": CASES})
    # (a skipif mark skips at setup: the guard turns that into an error)
    assert out.splitlines()[-1].startswith("1 failed, 1 passed, 3 skipped, 1 error"), out
    assert "FAILED test_cases.py::test_other_reason" in out and "ERROR test_cases.py::test_marked" in out
    assert "reason other than a missing GPU: this data file is not here" in out


def test_a_missing_import_at_collection_fails(tmp_path):
    out = _run(tmp_path, {"test_imports.py": 'import pytest\nlib = pytest.importorskip("no_such_module_here")\n'
                                              "def test_x():\n    pass\n"})
    assert "no_such_module_here" in out and " error" in out.lower(), out
    assert "skipped" not in out.splitlines()[-1], out
