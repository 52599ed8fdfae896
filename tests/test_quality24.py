"""tools/quality24.py on the CPU, tiny: every form of both trained models is evaluated, and the
quantized forms are the layers they name."""
import json
import math
import sys
from pathlib import Path

import sparsegen

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import quality24  # noqa: E402


def test_every_form_of_both_models_is_evaluated(tmp_path):
    out = tmp_path / "quality.json"
    quality24.main(["--steps", "2", "--d-model", "64", "--layers", "1", "--eval-batches", "1", "--corpus-mb", "1",
                    "--json", str(out)])
    rows = json.loads(out.read_text())["tables"][0]["rows"]
    assert [r[1] for r in rows] == list(quality24.FORMS) + [f for f in quality24.FORMS if f != "2:4"]
    assert all(math.isfinite(r[2]) and r[3] == math.exp(r[2]) for r in rows)
    assert rows[0][4] == 0 and len({r[2] for r in rows}) > 1


def test_forms_are_the_layers_they_name():
    args = quality24.train_demo.parse_args(["--d-model", "64", "--layers", "1", "--heads", "4", "--context", "16",
                                            "--device", "cpu"])
    model = quality24.train_demo.build(args, None)
    kinds = {name: type(m.blocks[0].ffn[0]) for name, m in quality24.forms(model, sparse_trained=False)}
    assert kinds["FP8 2:4"] is sparsegen.ScaledSparse24Linear and kinds["2:4"] is sparsegen.Sparse24Linear
    assert kinds["4-bit 2:4, group 128"] is kinds["4-bit 2:4, per channel"] is sparsegen.Int4Sparse24Linear
