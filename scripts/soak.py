"""A soak of "nothing lost": a long asynchronous run SIGKILLed again and again, resumed each time, against the
same run left alone.

    python scripts/soak.py --steps 500 --kills 10 --out runs/soak        (≈ 15 min on 2 cores)

Two runs of the tiny model at ``rollout.max_staleness`` K (default 2: the native engine in a worker process, two
batches in flight): the reference, uninterrupted, and the soak, killed ``--kills`` times with SIGKILL to its whole
process group (the trainer and its rollout worker, as an OOM killer or a preempted node does) at random moments —
half of them right after a checkpoint step, where the kill can land inside the save — and resumed with
``unison train --resume`` after each. It then checks, and writes to ``OUT/soak.json``:

* every metric of every step (timings and memory aside) and the final weights equal the reference's, bit for bit;
* the reference's resident memory (trainer and worker together, sampled from /proc) after step 50 grows by at most
  5% over its peak up to step 50 (until its last step: the report at the end loads matplotlib);
* the soak leaves no file the reference does not (no half-written checkpoint, no temporary file, no weight-sync
  leftovers), its checkpoints are the kept ones, and no shared-memory segment of its processes is left in /dev/shm.

Exit status 0 when every check holds, 1 otherwise. ``tests/test_soak.py`` (``slow``) runs a shorter version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REWARD = "def reward(response, item):\n    return len(response) / 10\n"  # real gradients on a random model
BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=8", "train.lr=1e-3",
        "log.console=false", "log.tensorboard=false", "task.truncated_reward=null", "checkpoint.every_minutes=0",
        "threads=1", "rollout.worker_threads=1"]
VOLATILE = ("time/", "throughput/", "memory/", "staleness/wait")
RSS_AFTER = 50


def _sets(args, out: Path) -> list[str]:
    return [f"--set={s}" for s in BASE + [f"task.reward={out / 'reward.py'}:reward", f"train.steps={args.steps}",
                                          f"rollout.max_staleness={args.k}", f"checkpoint.every={args.every}",
                                          f"checkpoint.keep={args.keep}", f"seed={args.seed}"]]


def _start(args, out: Path, run: Path, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "unison", "train", *([] if resume else [str(out / "config.yaml")]), "--out", str(run),
           *([] if resume else _sets(args, out))]
    if resume:
        cmd.append("--resume")
    log = open(run.parent / f"{run.name}.log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))


def _steps_done(run: Path) -> int:
    m = run / "metrics.jsonl"
    try:
        return sum(1 for line in m.read_text().splitlines() if line.endswith("}"))
    except FileNotFoundError:
        return 0


def _group_rss_mib(pgid: int) -> float:
    """Resident memory of every live process of process group ``pgid``, MiB."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return total / 1024


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def reference(args, out: Path) -> dict:
    """The uninterrupted run, its memory sampled twice a second: [(step, group RSS MiB)]."""
    run = out / "reference"
    proc = _start(args, out, run, resume=False)
    samples = []
    while proc.poll() is None:
        samples.append((_steps_done(run), _group_rss_mib(proc.pid)))
        time.sleep(0.5)
    if proc.returncode != 0:
        raise SystemExit(f"soak: the reference run failed (exit {proc.returncode}): {out / 'reference.log'}")
    early = [r for s, r in samples if s <= RSS_AFTER and r > 0]
    late = [r for s, r in samples if RSS_AFTER < s < args.steps and r > 0]  # (the end's report imports matplotlib)
    return {"rss_peak_to_step_50_mib": max(early) if early else None,
            "rss_peak_after_step_50_mib": max(late) if late else None, "rss_samples": len(samples)}


def kill_targets(rng: random.Random, steps: int, kills: int, every: int) -> list[int]:
    """``kills`` distinct steps in [3, steps − 3]: half of them right after a checkpoint step (the save may be in
    flight), the others anywhere in a step; two draws that snap to the same checkpoint step are drawn again."""
    saves = [s for s in range(every, steps - 2, every) if s >= 3]  # the checkpoint steps a kill can follow
    targets: set[int] = set()
    n = min(kills, steps - 5)
    while len(targets) < n:
        snap = len(targets) % 2 and len(saves) > sum(t in saves for t in targets)
        targets.add(rng.choice(saves) if snap else rng.randrange(3, steps - 2))
    return sorted(targets)


def soak(args, out: Path, rng: random.Random) -> dict:
    """The killed-and-resumed run: [(kill target step, the step the metrics reached, exit signal)]."""
    run = out / "soak"
    targets = kill_targets(rng, args.steps, args.kills, args.every)
    kills, resume, step_s = [], False, 0.3
    shm_before = _shm()
    metrics = run / "metrics.jsonl"
    for target in targets:
        old = metrics.stat().st_ino if metrics.exists() else None  # a resume rewrites it (truncated): a new file
        proc = _start(args, out, run, resume)
        resume = True
        while old is not None and metrics.stat().st_ino == old and proc.poll() is None:
            time.sleep(0.02)
        t0, first = time.monotonic(), _steps_done(run)
        while _steps_done(run) < target and proc.poll() is None:
            time.sleep(0.02)
        if proc.poll() is not None:  # finished or failed before the target: no kill this round
            break
        done = _steps_done(run)
        step_s = max((time.monotonic() - t0) / max(done - first, 1), 0.05)
        time.sleep(rng.uniform(0, step_s))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.2)  # the worker, killed with the group, is reaped by init
        kills.append({"target_step": target, "metrics_at_kill": _steps_done(run), "returncode": proc.returncode})
    proc = _start(args, out, run, resume)
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"soak: the last resume failed (exit {proc.returncode}): {out / 'soak.log'}")
    return {"kills": kills, "shm_left": sorted(_shm() - shm_before)}


def _comparable(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _files(run: Path) -> set[str]:
    return {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}


def _same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)


def check(args, out: Path, ref: dict, sk: dict) -> dict:
    a, b = _comparable(out / "reference"), _comparable(out / "soak")
    differing = [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y]
    final = f"checkpoints/step_{args.steps:06d}/model/model.safetensors"
    extra = sorted(_files(out / "soak") - _files(out / "reference"))
    missing = sorted(_files(out / "reference") - _files(out / "soak"))
    kept = sorted(p.name for p in (out / "soak" / "checkpoints").iterdir())
    want_kept = [f"step_{s:06d}" for s in sorted({*range(args.every, args.steps + 1, args.every), args.steps})][-args.keep:]
    growth = (ref["rss_peak_after_step_50_mib"] / ref["rss_peak_to_step_50_mib"] - 1
              if ref["rss_peak_to_step_50_mib"] and ref["rss_peak_after_step_50_mib"] else None)
    checks = {
        "every_step_equal": len(a) == len(b) == args.steps and not differing,
        "final_weights_equal": _same_weights(out / "reference" / final, out / "soak" / final),
        "rss_growth_after_step_50_at_most_5pct": growth is not None and growth <= 0.05 if args.steps > RSS_AFTER
        else True,
        "no_file_left_behind": not extra and not missing and kept == want_kept and not sk["shm_left"],
        "every_kill_was_a_sigkill": all(k["returncode"] == -signal.SIGKILL for k in sk["kills"]),
    }
    return {"checks": checks, "passed": all(checks.values()), "steps": args.steps, "K": args.k,
            "kills": sk["kills"], "differing_steps": differing[:20], "extra_files": extra[:20],
            "missing_files": missing[:20], "checkpoints_kept": kept, "shm_left": sk["shm_left"],
            "rss_growth_after_step_50": growth, **ref}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--k", type=int, default=2, help="rollout.max_staleness (default 2)")
    p.add_argument("--every", type=int, default=25, help="checkpoint.every (default 25)")
    p.add_argument("--keep", type=int, default=2, help="checkpoint.keep (default 2)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed and the kills' (default 0)")
    p.add_argument("--out", default="runs/soak")
    args = p.parse_args(argv)
    if args.kills > args.steps - 6:
        p.error(f"--kills {args.kills} needs more than {args.kills + 5} steps")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {out} is not empty: choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward.py").write_text(REWARD)
    (out / "config.yaml").write_text("model: builtin:tiny\n")  # the rest: BASE and the options, as --set
    t0 = time.monotonic()
    ref = reference(args, out)
    t_ref = time.monotonic() - t0
    sk = soak(args, out, random.Random(args.seed))
    result = {**check(args, out, ref, sk), "wall_s_reference": t_ref, "wall_s_soak": time.monotonic() - t0 - t_ref}
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "kills"}, indent=2))
    print(f"soak: {len(sk['kills'])} kills; {'every check held' if result['passed'] else 'FAILED'}: {out / 'soak.json'}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
