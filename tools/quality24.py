"""What 2:4 and its quantized forms cost in model quality: a small GPT (tools/train_demo.py's, on
the Python standard library's sources, byte tokens) trained dense and trained with every block
projection 2:4 (fixed magnitude mask, kept values trained), then each evaluated on held-out
text as trained and with its block projections quantized (FP8 2:4, int8 2:4, 4-bit 2:4 in
groups of 128 and per channel, round to nearest; the dense model is pruned to 2:4 by
magnitude first, with no fine-tuning). Runs where it is (the CPU: the layers' reference
paths; a GPU: the kernels).
PYTHONPATH=. python tools/quality24.py [--steps 300 --d-model 256 --layers 4] [--json tools/results/45_quality24.json]"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sparsegen  # noqa: E402
import train_demo  # noqa: E402
from bench_record import Table, write  # noqa: E402

PROJECTIONS = r"blocks\.\d+\.(qkv|proj|ffn\.0|ffn\.2)"
# Evaluated forms of a trained model: the block projections' patch rule (None: as trained)
FORMS = {"as trained": None, "2:4": {"sparsity": "2:4"},
         "FP8 2:4": {"sparsity": "2:4", "weight_dtype": "e4m3"}, "int8 2:4": {"sparsity": "2:4", "weight_dtype": "int8"},
         "4-bit 2:4, group 128": {"sparsity": "2:4", "weight_dtype": "int4"},
         "4-bit 2:4, per channel": {"sparsity": "2:4", "group_size": -1}}


def trained(args, sparse: bool, train_data, val_data) -> torch.nn.Module:
    """A GPT trained `args.steps` steps, its block projections 2:4 from the start if `sparse`
    (all of them: train_demo's "2:4" model patches the FFN alone)."""
    model = train_demo.build(args, None)
    if sparse:
        sparsegen.patch(model, {PROJECTIONS: {"sparsity": "2:4"}}, from_dense=True)
    train_demo.train(args, None, train_data, val_data, model=model.to(args.device))
    return model


def forms(model: torch.nn.Module, sparse_trained: bool):
    """(form, model) for every FORMS entry that applies: each from a dense copy of `model` (a
    2:4-trained one keeps its mask: its pruned weights are zeros, the smallest magnitudes)."""
    for name, rule in FORMS.items():
        if rule is None:
            yield name, model
        elif not (sparse_trained and name == "2:4"):
            copy = sparsegen.dense_copy(model)
            sparsegen.patch(copy, {PROJECTIONS: rule})
            yield name, copy


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--corpus-mb", type=int, default=4)
    known, rest = parser.parse_known_args(argv)
    args = train_demo.parse_args(["--steps", "300", "--d-model", "256", "--layers", "4", "--heads", "4",
                                  "--context", "128", "--batch", "16", "--log-every", "100", "--eval-batches", "16",
                                  "--no-graph", *rest])
    data = train_demo.corpus(known.corpus_mb << 20)
    split = int(0.95 * data.numel())
    table = Table("Whole models", "Model quality: a small GPT dense, 2:4 and quantized 2:4 (held-out loss)", [
        ("model", ""), ("form", ""), ("val loss", ".4f"), ("perplexity", ".3f"), ("loss - dense", "+.4f")],
        f"GPT {args.layers} layers, d_model {args.d_model}, context {args.context}, byte tokens of the Python "
        f"standard library's sources; {args.steps} steps of batch {args.batch}; loss over {args.eval_batches} "
        "held-out batches; quantized forms round to nearest (no calibration, no fine-tuning)")
    dense_loss = None
    for sparse in (False, True):
        model = trained(args, sparse, data[:split], data[split:])
        for form, evaluated in forms(model, sparse):
            loss = train_demo.evaluate(evaluated.eval(), data[split:], args)
            dense_loss = loss if dense_loss is None else dense_loss
            label = "trained 2:4 (block projections)" if sparse else "trained dense"
            table.add(label, form, loss, math.exp(loss), loss - dense_loss)
    write(known.json, "quality24.py", sys.argv[1:] if argv is None else argv, [table])


if __name__ == "__main__":
    main()
