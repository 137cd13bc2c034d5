"""Threads on a quiet and on a busy machine: the demo and one SmolLM2 step at 1 and 2 threads and ``auto``.

Issue 32: on a 2-core machine beside one CPU-bound job, ``make demo`` took 51 min with torch's default
threads and 2 min 16 s with ``OMP_NUM_THREADS=1``. This runs, in fresh ``python -m unison`` processes
(the user's path: the command line sets the OpenMP wait policy before torch loads), each workload once
per arm, first on a quiet machine, then with one competing CPU-bound process (a single-threaded numpy
matmul loop, or ``--competitor python``: a pure Python loop), and prints JSON with the times and ratios:

* workloads (``--workloads``): ``sft`` — the demo's supervised warm start (``unison sanity``'s recipe,
  ``--sft-steps`` steps); ``arms`` — the demo's three RL arms (fp16, bf16, fp32; ``unison sanity``'s
  defaults, ``--steps`` steps each, from one prepared SFT model and filtered set); ``smollm2`` —
  ``--smollm2-steps`` RL steps of SmolLM2-135M (``builtin:smollm2``: 8 short chat prompts × 4 samples ×
  128 new tokens, fp32, a length reward; needs ``make install-smollm2``), timed by the median of the
  steps after the first (one step of a run varies by ±15% on this machine from run to run);
* arms (``--arms``): ``1``, ``2`` (``--threads N``), ``auto`` (the default), and ``2-spin``: 2 threads
  with libgomp's own spin-waiting (``GOMP_SPINCOUNT=300000``, libgomp's default when no wait policy is
  set: what unison did before issue 32).

Reported per workload and arm: wall seconds of the process and of the work itself (sft: its
``wall_s``; arms: the sum of the three arms' step times; smollm2: the median ``time/step_s`` of its
steps after the first), the
thread count each process chose, and ``loaded_over_quiet``. ``goals``: with one competing process the
``auto`` arm is at most 2.5× slower than quiet, and quiet ``auto`` is within 10% of the best of 1 and 2.
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are removed from the children's environment (``auto`` would
honour them). Run it on a quiet machine — nothing else running — or the "quiet" figures are not:

    python benchmarks/threads.py                        # ≈ 1–2 h on 2 cores, most of it the 2-spin arm loaded
    python benchmarks/threads.py --arms 1,2,auto        # without the old behaviour's slow arm
    python benchmarks/threads.py --quick                # a check that it runs (≈ 3 min), not figures
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_model  # noqa: E402 - a sibling module (python benchmarks/...)

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"1": {"threads": "1"}, "2": {"threads": "2"}, "auto": {"threads": None},
        "2-spin": {"threads": "2", "env": {"GOMP_SPINCOUNT": "300000"}}}
REWARD = "def reward(response, item=None):\n    return min(len(response), 100) / 100\n"
COMPETITORS = {
    "numpy": "import numpy as np\na = np.random.rand(256, 256)\nwhile True:\n    a = a @ a\n    a /= np.abs(a).max()\n",
    "python": "x = 0\nwhile True:\n    x = (x + 1) % 1000003\n",
}
#: the environment of every child: no thread count from the caller, one-threaded BLAS in the competitor
STRIP = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in STRIP}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, **(extra or {})}


def unison(args: list[str], arm: str, log: Path, timeout: float, cwd: Path) -> dict:
    """``python -m unison ARGS`` under ``arm``: wall seconds, exit code, the thread line(s) it printed."""
    spec = ARMS[arm]
    cmd = [sys.executable, "-m", "unison", *args] + (["--threads", spec["threads"]] if spec["threads"] else [])
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(spec.get("env")), cwd=cwd,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    chosen = sorted(set(re.findall(r"\bthreads \d+ \([^)]*\)", text)))
    if rc not in (0, "timeout"):
        raise SystemExit(f"threads: `{' '.join(cmd)}` failed (exit {rc}); the end of {log}:\n{text[-3000:]}")
    return {"wall_s": round(wall, 1), "timed_out": rc == "timeout", "threads_chosen": chosen}


# ------------------------------------------------------------------ workloads
def sanity_sets(args) -> list[str]:
    return ["--set", f"sft.steps={args.sft_steps}", "--set", f"train.steps={args.steps}"]


def prepare(args, work: Path) -> Path:
    """One SFT model and filtered set for every arms run (``unison sanity`` reuses both)."""
    base = work / "base"
    if "arms" in args.workloads:
        r = unison(["sanity", "--out", str(base), "--precisions", "fp32", *sanity_sets(args), "--set", "train.steps=1"],
                   "auto", work / "prepare.log", args.timeout, work)
        if r["timed_out"]:
            raise SystemExit("threads: preparing the SFT model timed out")
    return base


def run_sft(args, work: Path, arm: str, tag: str) -> dict:
    from unison.sanity import DEFAULTS

    out = work / f"sft-{tag}-{arm}"
    sets = [x for d in DEFAULTS for x in ("--set", d)]
    r = unison(["sft", "--out", str(out), *sets, "--set", f"sft.steps={args.sft_steps}"], arm,
               work / f"sft-{tag}-{arm}.log", args.timeout, work)
    if not r["timed_out"]:
        r["work_s"] = round(json.loads((out / "sft.json").read_text())["wall_s"], 1)
    return r


def run_arms(args, work: Path, arm: str, tag: str, base: Path) -> dict:
    out = work / f"arms-{tag}-{arm}"
    out.mkdir()
    shutil.copytree(base / "sft", out / "sft")
    shutil.copy(base / "perfectible.jsonl", out / "perfectible.jsonl")
    r = unison(["sanity", "--out", str(out), *sanity_sets(args)], arm, work / f"arms-{tag}-{arm}.log",
               args.timeout, work)
    if not r["timed_out"]:
        arms = json.loads((out / "report.json").read_text())["arms"]
        r["work_s"] = round(sum(a["wall_s"] for a in arms), 1)
        r["per_arm_s"] = {a["arm"]: round(a["wall_s"], 1) for a in arms}
    return r


def run_smollm2(args, work: Path, arm: str, tag: str) -> dict:
    out = work / f"smollm2-{tag}-{arm}"
    sets = ["model=builtin:smollm2", "precision=fp32", "task.name=jsonl",
            f"task.path={ROOT / 'unison' / 'data' / 'prompts.jsonl'}", f"task.reward={work / 'length_reward.py'}:reward",
            "task.truncated_reward=null", f"train.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}", "train.lr=1e-6", f"train.steps={args.smollm2_steps}",
            "log.console=false",
            "log.tensorboard=false", "checkpoint.every_minutes=0"]
    r = unison(["train", str(work / "empty.yaml"), "--out", str(out), *[x for s in sets for x in ("--set", s)]], arm,
               work / f"smollm2-{tag}-{arm}.log", args.timeout, work)
    if not r["timed_out"]:
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        timed = rows[1:] or rows  # the first step is warm-up when there are more

        def median(key):
            vals = sorted(x[key] for x in timed if isinstance(x.get(key), (int, float)))
            return round(statistics.median(vals), 1) if vals else None

        r["work_s"] = median("time/step_s")
        r["steps_s"] = [round(x["time/step_s"], 1) for x in rows]
        r["phases_s"] = {k.split("/")[1]: median(k) for k in ("time/generate_s", "time/update_s")}
        r["gemm_chosen"] = sorted(set(re.findall(r"fp32 matmuls \w+ \([^)]*\)", log_text(work, tag, arm))))
    return r


def log_text(work: Path, tag: str, arm: str) -> str:
    return (work / f"smollm2-{tag}-{arm}.log").read_text(errors="replace")


# ------------------------------------------------------------------ the competitor
class Competitor:
    """One CPU-bound process beside the runs (single-threaded)."""

    def __init__(self, kind: str):
        env = child_env({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.proc = subprocess.Popen([sys.executable, "-c", COMPETITORS[kind]], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # running, and visible in the idle sample of `auto`

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def ratio(a, b):
    return round(a / b, 2) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="sft,arms,smollm2", help="comma-separated: sft, arms, smollm2")
    ap.add_argument("--arms", default="1,2,auto,2-spin", help="comma-separated: 1, 2, auto, 2-spin")
    ap.add_argument("--steps", type=int, default=20, help="RL steps of each of the demo's arms (the demo: 100)")
    ap.add_argument("--sft-steps", type=int, default=150, help="SFT steps (the demo: 600)")
    ap.add_argument("--prompts", type=int, default=8, help="smollm2: prompts per step (the 8 built-in ones)")
    ap.add_argument("--n", type=int, default=4, help="smollm2: samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="smollm2: new tokens")
    ap.add_argument("--smollm2-steps", type=int, default=3, help="smollm2: RL steps per run (the first not timed)")
    ap.add_argument("--competitor", default="numpy", choices=sorted(COMPETITORS))
    ap.add_argument("--conditions", default="quiet,loaded", help="comma-separated: quiet, loaded")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one process may take (else: timed out)")
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks that the script runs, no figures")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.sft_steps, args.prompts, args.n, args.max_new_tokens, args.smollm2_steps = 2, 5, 2, 2, 8, 1
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms: unknown arm '{a}' (choose from {', '.join(ARMS)})")
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    work = Path(tempfile.mkdtemp(prefix="unison-threads-"))
    (work / "length_reward.py").write_text(REWARD)
    (work / "empty.yaml").write_text("{}\n")
    if "smollm2" in args.workloads:
        try:
            from unison.models import smollm2_gguf

            smollm2_gguf()
        except Exception as e:  # noqa: BLE001 - say why and go on without it
            print(f"threads: skipping smollm2 ({e})", file=sys.stderr)
            args.workloads.remove("smollm2")
    base = prepare(args, work)
    results: dict = {w: {c: {} for c in conditions} for w in args.workloads}
    for cond in conditions:
        comp = Competitor(args.competitor) if cond == "loaded" else None
        try:
            for w in args.workloads:
                for arm in arms:
                    print(f"threads: {cond} {w} {arm}", file=sys.stderr, flush=True)
                    if w == "sft":
                        results[w][cond][arm] = run_sft(args, work, arm, cond)
                    elif w == "arms":
                        results[w][cond][arm] = run_arms(args, work, arm, cond, base)
                    else:
                        results[w][cond][arm] = run_smollm2(args, work, arm, cond)
        finally:
            if comp is not None:
                comp.stop()
    ratios, goals = {}, {}
    for w, by in results.items():
        q, l = by.get("quiet", {}), by.get("loaded", {})
        ratios[w] = {"loaded_over_quiet": {a: ratio(l.get(a, {}).get("work_s"), q.get(a, {}).get("work_s"))
                                           for a in arms if a in q and a in l}}
        fixed = [q[a]["work_s"] for a in ("1", "2") if q.get(a, {}).get("work_s")]
        if "auto" in q and fixed and q["auto"].get("work_s"):
            ratios[w]["quiet_auto_over_best_fixed"] = ratio(q["auto"]["work_s"], min(fixed))
            goals[f"{w}: quiet auto within 10% of the best of 1 and 2 threads"] = \
                ratios[w]["quiet_auto_over_best_fixed"] <= 1.10
        lq = ratios[w]["loaded_over_quiet"].get("auto")
        if lq is not None:
            goals[f"{w}: with one competing process, auto at most 2.5x slower than quiet"] = lq <= 2.5
    from unison.threads import usable_cores

    print(json.dumps({
        "benchmark": "threads", "cpu": cpu_model(), "cores": usable_cores()[0], "quick": args.quick,
        "settings": {"workloads": args.workloads, "arms": arms, "steps": args.steps, "sft_steps": args.sft_steps,
                     "smollm2": {"prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                                 "steps": args.smollm2_steps},
                     "competitor": args.competitor, "conditions": conditions},
        "results": results, "ratios": ratios, "goals": goals,
        **({"work_dir": str(work)} if args.keep else {}),
    }, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
