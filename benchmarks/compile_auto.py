"""Do ``compile: auto`` and ``compile: measure`` pick the faster side, and what do they cost? (issue 56, item 5)

Three parts, one JSON line:

1. **A first run's cost**: the start-up decisions a newcomer's first run makes, ``gemm: auto`` and
   ``compile: auto``, from an empty ``$UNISON_HOME`` in a fresh process, timed (the target: ≤ 10 s together).
2. **Fresh measurements**: ``compile: measure`` from an empty ``$UNISON_HOME`` and an empty Inductor cache,
   ``--repeats`` times, each in a fresh process as a run makes it: each side's choice, its figures, and the seconds
   it cost.
3. **The long timing**: one decoder layer, eager and compiled, at the same shapes, ``--rounds`` alternated rounds,
   three times: which side is really faster, and by how much.

A measurement's choice agrees with the long timing when it compiles a side that the long timing finds at least
``compilation.SPEEDUP`` × faster, or keeps eager one that it does not (the rule's margin: a side faster by less is
not compiled by design, whatever the run's length).

    python benchmarks/compile_auto.py --model builtin:smollm2                # 10 measurements
    python benchmarks/compile_auto.py --model builtin:smollm2 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

ONE = """
import json, sys, time, torch
torch.set_num_threads({threads})
t0 = time.perf_counter()
from unison import compilation, gemm
from unison.models import model_config
shape = compilation.RunShape(*{shape})
from pathlib import Path
cfg = model_config(Path({model!r}))
params = {params}
t1 = time.perf_counter()
g = gemm.decide({gemm!r}, cfg.hidden_size, cfg.intermediate_size, params, decode_rows=shape.rows,
                vocab=cfg.vocab_size)
t2 = time.perf_counter()
c = compilation.decide({setting!r}, {model!r}, params, shape, engine_packed=g.engine == "onednn")
t3 = time.perf_counter()
print(json.dumps({{"engine": c.engine, "learner": c.learner, "reasons": [c.engine_reason, c.learner_reason],
                  "gemm": [g.name, g.engine], "gemm_s": t2 - t1, "compile_s": t3 - t2,
                  "kept": json.loads(compilation.default_cache().read_text()) if compilation.default_cache().exists() else {{}}}}))
"""


def fresh_decision(a, setting: str, gemm_setting: str) -> dict:
    """One decision in a fresh process with an empty $UNISON_HOME and an empty Inductor cache."""
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, UNISON_HOME=home, TORCHINDUCTOR_CACHE_DIR=str(Path(home) / "inductor"))
        code = ONE.format(threads=a.threads, shape=tuple(a.shape), model=str(a.model), params=a.params,
                          gemm=gemm_setting, setting=setting)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"compile_auto: the decision failed:\n{out.stderr[-3000:]}")
        d = json.loads(out.stdout.strip().splitlines()[-1])
        d["process_s"] = time.perf_counter() - t0
        return d


def long_timing(a) -> dict:
    """Eager over compiled, one layer, the run's shapes, ``rounds`` alternated rounds, three times per side."""
    import torch

    from unison import compilation

    torch.set_num_threads(a.threads)
    shape = compilation.RunShape(*a.shape)
    with tempfile.TemporaryDirectory() as d:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        engine = [compilation.measure_engine(a.model, shape, a.packed, rounds=a.rounds) for _ in range(3)]
        learner = [compilation.measure_learner(a.model, shape, rounds=max(a.rounds // 3, 4)) for _ in range(3)]
    return {side: [m["eager_s"] / m["compiled_s"] for m in ms] for side, ms in (("engine", engine),
                                                                               ("learner", learner))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory or builtin:NAME (e.g. builtin:smollm2)")
    p.add_argument("--shape", type=int, nargs=6, default=[60, 32, 128, 46, 4, 512],
                   metavar=("STEPS", "ROWS", "NEW", "PROMPT", "MICRO_BATCHES", "MICRO_TOKENS"),
                   help="the run's shape (compilation.RunShape; default: 60 steps of 32 rows × 128 new tokens after "
                        "46-token prompts, 4 micro-batches of 512 tokens)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--packed", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's fp32 products pre-packed (oneDNN), as gemm: auto chose for SmolLM2's engine")
    a = p.parse_args()
    import torch

    from unison import compilation
    from unison.models import load_model, resolve_model_dir

    a.model = resolve_model_dir(a.model)
    a.threads = a.threads or torch.get_num_threads()
    a.params = sum(t.numel() for t in load_model(a.model, dtype=torch.float32).parameters())
    first = fresh_decision(a, "auto", "auto")
    print(f"[compile_auto] a first run's decisions: gemm {first['gemm_s']:.1f} s, compile {first['compile_s']:.1f} s",
          file=sys.stderr, flush=True)
    decisions = []
    for i in range(a.repeats):
        decisions.append(fresh_decision(a, "measure", "onednn" if a.packed else "blas"))
        d = decisions[-1]
        print(f"[compile_auto] measurement {i + 1}/{a.repeats}: engine {d['engine']}, learner {d['learner']} "
              f"({d['compile_s']:.0f} s)", file=sys.stderr, flush=True)
    ratios = long_timing(a)
    out = {"benchmark": "compile_auto", "cpu": cpu_model(), "threads": a.threads, "torch": torch.__version__,
           "model": a.model.name, "shape": dict(zip(("steps", "rows", "new", "prompt", "micro_batches",
                                                     "micro_tokens"), a.shape)), "packed": a.packed,
           "first_run": {"gemm_auto_s": first["gemm_s"], "compile_auto_s": first["compile_s"],
                         "together_s": first["gemm_s"] + first["compile_s"], "reasons": first["reasons"]},
           "measure_s": [d["compile_s"] for d in decisions], "speedup_rule": compilation.SPEEDUP}
    for i, side in enumerate(("engine", "learner")):
        rs = ratios[side]
        pays = min(rs) >= compilation.SPEEDUP
        right = pays if (pays or max(rs) < compilation.SPEEDUP) else None  # None: the long timings straddle it
        chosen = [d[side] for d in decisions]
        measured = [m[side] for d in decisions for m in d["kept"].values()]
        out[side] = {"long_ratio_eager_over_compiled": rs, "compiled_pays": right,
                     "measure_compiled": sum(chosen), "measure_eager": len(chosen) - sum(chosen),
                     "measure_agree": None if right is None else sum(c == right for c in chosen),
                     "auto_first_run_compiled": first[side],
                     "measured_ratio": [m["eager_s"] / m["compiled_s"] for m in measured if m and m["compiled_s"]],
                     "measured_compile_s": [m["compile_s"] for m in measured if m and m["compile_s"]],
                     "reasons": sorted({d["reasons"][i] for d in decisions})}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
