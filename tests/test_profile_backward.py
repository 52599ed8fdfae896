"""tools/profile_backward.py on the CPU (PyTorch's 2:4 path): it times both layers and lists
where the 2:4 gradients' host time goes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import profile_backward  # noqa: E402


def test_the_tool_times_both_layers_and_profiles_the_gradients(capsys):
    assert profile_backward.main(["--device", "cpu", "--shape", "64,32", "--calls", "2", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "nn.Linear: forward" in out and "Sparse24Linear transposable: forward" in out
    assert "the 2:4 gradients alone" in out and "autograd.py" in out  # (the profile names the gradient code)
