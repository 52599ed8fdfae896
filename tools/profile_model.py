"""Where a whole model's host time goes: cProfile over forwards of one of bench_models' cases
(default BERT-base, batch 16 x 128) with each variant, eager or compiled.
GPU: PYTHONPATH=. python tools/profile_model.py [--compile] [--case NAME] [variant ...]"""
import cProfile
import io
import pstats
import sys

import torch

import bench_models  # tools/ is on sys.path when run as a script


def profile(variant: str, mode: str, case_name: str = "bert16", calls: int = 20) -> None:
    case, = bench_models.cases([case_name], torch.device("cuda"), smoke=False)
    model = bench_models.patched(case.make_model(), case.family, variant)
    step = case.make_step(bench_models.in_mode(model, mode))
    reset = getattr(step, "reset", lambda: None)  # (a decode step rewinds its static cache)
    with torch.no_grad():
        for _ in range(3):
            reset()
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        for _ in range(calls):
            reset()
            prof.enable()
            step()
            prof.disable()
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(f"==== {case_name}, {variant}, {mode}, {calls} forwards\n" + out.getvalue()[-4000:], flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = "compile" if "--compile" in args else "eager"
    case_name = args[args.index("--case") + 1] if "--case" in args else "bert16"
    named = [a for i, a in enumerate(args) if a not in ("--compile", "--case") and (i == 0 or args[i - 1] != "--case")]
    for variant in named or ["dense", "2:4", "b128d0.25"]:
        profile(variant, mode, case_name)
