"""Does ``gemm: auto`` pick the faster library, decision after decision? (issue 56, item 5)

Repeats the start-up decision (:func:`unison.gemm.decide`, both roles) ``--repeats`` times, each in a fresh Python
process as a run makes it, for a model's sizes (default: SmolLM2-135M's — hidden 576, MLP 1536, vocabulary 49152,
135M parameters), and then times both libraries on the same products for longer (``--rounds`` interleaved rounds,
best of each, three times) to say which side is really faster. One JSON line: each role's choices, how many agree
with the long timing, the long ratios, and the seconds one decision costs.

    python benchmarks/gemm_auto.py                    # SmolLM2's sizes, 10 decisions, this CPU's thread count
    python benchmarks/gemm_auto.py --repeats 10 --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

ONE = """
import json, sys, time, torch
torch.set_num_threads({threads})
from unison import gemm
t0 = time.perf_counter()
g = gemm.decide("auto", {hidden}, {inter}, {params}, decode_rows={rows}, vocab={vocab})
print(json.dumps({{"learner": g.name, "engine": g.engine, "reasons": [g.reason, g.engine_reason],
                  "seconds": time.perf_counter() - t0}}))
"""


def long_ratios(hidden: int, inter: int, rows: int, vocab: int, rounds: int) -> dict:
    """BLAS time over oneDNN time for each role's products, timed ``rounds`` interleaved rounds, three times."""
    from unison import gemm

    learner = [gemm.measure(hidden, inter, rounds=rounds)[0] for _ in range(3)]
    engine = [gemm.measure_packed(hidden, inter, rows=rows, rounds=rounds, vocab=vocab)[0] for _ in range(3)]
    return {"learner": learner, "engine": engine}


def gemm_margin() -> float:
    from unison import gemm

    return gemm.MARGIN


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--params", type=int, default=134_515_008)
    p.add_argument("--rows", type=int, default=32, help="the engine's decode rows")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the long timing")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    import torch

    threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    code = ONE.format(threads=threads, hidden=a.hidden, inter=a.intermediate, params=a.params, rows=a.rows,
                      vocab=a.vocab)
    decisions = []
    for i in range(a.repeats):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        decisions.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"[gemm_auto] decision {i + 1}/{a.repeats}: learner {decisions[-1]['learner']}, engine "
              f"{decisions[-1]['engine']} ({decisions[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    ratios = long_ratios(a.hidden, a.intermediate, a.rows, a.vocab, a.rounds)
    out = {"benchmark": "gemm_auto", "cpu": cpu_model(), "threads": threads, "torch": torch.__version__,
           "sizes": {"hidden": a.hidden, "intermediate": a.intermediate, "vocab": a.vocab, "rows": a.rows},
           "repeats": a.repeats, "decision_s": [d["seconds"] for d in decisions], "long_timing_s": time.perf_counter() - t0}
    for role in ("learner", "engine"):
        rs = ratios[role]
        faster = "onednn" if min(rs) > 1.0 else "blas" if max(rs) < 1.0 else "either (the long timings straddle 1)"
        chosen = [d[role] for d in decisions]
        out[role] = {"chosen": {c: chosen.count(c) for c in sorted(set(chosen))},
                     "long_ratio_blas_over_onednn": rs, "faster": faster,
                     "agree_with_faster": sum(c == faster for c in chosen) if faster in ("blas", "onednn") else None,
                     # auto takes oneDNN only at >= MARGIN x: a side faster by less is not a wrong choice by design
                     "within_margin": all(1 / gemm_margin() < r < gemm_margin() for r in rs),
                     "reasons": sorted({d["reasons"][role == "engine"] for d in decisions})}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
