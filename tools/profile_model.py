"""Where a whole model's host time goes: cProfile over eager forwards of BERT-base (batch 16
x 128) with each variant, eager or compiled.
GPU: PYTHONPATH=. python tools/profile_model.py [--compile] [variant ...]"""
import cProfile
import io
import pstats
import sys

import torch

import bench_models  # tools/ is on sys.path when run as a script


def profile(variant: str, mode: str, calls: int = 20) -> None:
    case = bench_models.bert_case(16, torch.device("cuda"), torch.float16, smoke=False)
    model = bench_models.patched(case.make_model(), case.family, variant)
    step = case.make_step(bench_models.in_mode(model, mode))
    with torch.no_grad():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"==== BERT-base b16, {variant}, {mode}, {calls} forwards\n" + out.getvalue()[-4000:], flush=True)


if __name__ == "__main__":
    mode = "compile" if "--compile" in sys.argv else "eager"
    for variant in [a for a in sys.argv[1:] if a != "--compile"] or ["dense", "2:4", "b128d0.25"]:
        profile(variant, mode)
