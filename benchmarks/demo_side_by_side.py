"""Do two demo runs side by side slow each other? (issue 38: the demo runs part 2 two at a time, one process each.)

One of part 2's runs (the stale regime's, ``--staleness`` K: 4 = the broken run, two processes each; 0 = the clean
run, one; from the shipped warm start, ``--steps`` steps) alone, then two of it at once (seeds 0 and 1), each in its own process; the JSON line gives each wall time and the ratio
side-by-side / alone (the demo's budget: ≤ 1.15).

    .venv/bin/python benchmarks/demo_side_by_side.py [--steps 30] [--staleness 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, seeds: list[int], steps: int, staleness: int) -> list[float]:
    from unison.demo import COLLAPSE_RECIPE, REGIMES, WARM_STARTS

    reg = REGIMES["stale"]
    procs = []
    for s in seeds:
        d = out / f"s{s}"
        (d / "sft").mkdir(parents=True)
        shutil.copytree(WARM_STARTS / "collapse" / "model", d / "sft" / "model")
        shutil.copy(WARM_STARTS / "collapse" / "perfectible.jsonl", d / "perfectible.jsonl")
        sets = [x for kv in COLLAPSE_RECIPE + reg.recipe + [f"train.steps={steps}", f"rollout.max_staleness={staleness}"]
                for x in ("--set", kv)]
        cmd = [sys.executable, "-m", "unison", "sanity", "--out", str(d), "--precisions", "fp32", "--seeds", str(s),
               "--max-prompts", "64", *sets]
        procs.append((time.perf_counter(), subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                                            stderr=subprocess.DEVNULL)))
    walls = []
    for t0, p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a run failed: {p.args}")
        walls.append(time.perf_counter() - t0)
    return walls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--staleness", type=int, default=4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        alone = run(Path(tmp) / "alone", [0], a.steps, a.staleness)[0]
        pair = run(Path(tmp) / "pair", [0, 1], a.steps, a.staleness)
    print(json.dumps({"benchmark": "demo_side_by_side", "cpu": cpu_model(), "regime": "stale", "max_staleness": a.staleness, "steps": a.steps,
                      "alone_s": round(alone, 1), "side_by_side_s": [round(x, 1) for x in pair],
                      "ratio": round(max(pair) / alone, 3)}))


if __name__ == "__main__":
    main()
