"""``unison demo`` (``make demo``): what unison is for, in a few minutes on two CPU cores.

1. Paper A's sanity test, shortened: the same GRPO run once per precision (fp16, bf16, fp32) — the
   mismatch each precision causes (token k3), and that at this scale none of them decides the outcome.
2. A run that collapses and the same run cured: int4 rollout weights (the rollout engine samples with
   4-bit weights, the learner trains fp32 masters, as peers do for speed) make GRPO's training accuracy
   fall; the same run with ``train.quantization_aware: true`` (the learner computes through the rollout's
   quantizer: π is the policy μ samples from) does not. The fp32 arm of part 1 is the clean run beside them.
3. One report: both tables, the three curves in one plot, the mismatch ledger of each run (where its
   mismatch came from), and one line saying what was seen.

Everything is built on ``unison sanity`` (shared SFT warm start and perfectible set, one directory per arm);
rerunning with the same ``--out`` reuses what is finished.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from unison.config import Config
from unison.errors import UnisonError

#: part 2: the cure, as an arm variant (name suffix, config overrides)
CURE = ("-qat", {"train": {"quantization_aware": True}})
#: part 1's length: the arithmetic sanity test reaches 95% by step ≈ 20 on the CPUs measured
PRECISION_STEPS = ["train.steps=40"]
#: part 2's recipe: experiments/quantized_rollout's (chained sums with the working written out, 69-token answers,
#: 16 prompts × 8, 4 mini-batches per step, lr 1e-4), cut from 60 steps to 40 — the cheapest collapse we found.
#: Seed 0 on an AMD EPYC (docs/experiments/cures.md, steps 1–10 → 31–40): int4 GRPO 0.79 → 0.56, the same run
#: quantization-aware 0.76 → 0.87, the clean run 0.83 → 0.88 (the LR is constant: the first 40 of 60 steps)
COLLAPSE_RECIPE = ["task.name=scratchpad", "task.operands=7", "task.digits=2", "task.style=full",
                   "task.train_size=600", "task.eval_size=200", "rollout.max_new_tokens=96", "sft.steps=600",
                   "train.steps=40", "train.lr=1e-4", "train.prompts_per_step=16", "rollout.n=8",
                   "train.mini_batches=4", "train.micro_batch_size=64", "train.micro_batch_tokens=null"]


def run_demo(precision_cfg: Config, collapse_cfg: Config, out: Path, precisions: list[str],
             log=lambda m: print(m, file=sys.stderr, flush=True), quantization: str = "int4", k: int = 8,
             max_prompts: int | None = 32, collapse_prompts: int | None = 64) -> dict:
    """Run the demo's two parts (``out/precision``, ``out/collapse``) and write ``out/report.md``."""
    from unison.report import summarize
    from unison.sanity import run_sanity

    t0 = time.perf_counter()
    log(f"[demo] part 1/2: the same GRPO run once per precision ({', '.join(precisions)})")
    _, _, prec_dirs = run_sanity(precision_cfg, out / "precision", precisions, ["grpo"], log=log, report=False, k=k,
                                 max_prompts=max_prompts)
    t1 = time.perf_counter()
    log(f"[demo] part 2/2: a run that collapses ({quantization} rollout weights) and the same run cured "
        f"(a quantization-aware learner), beside the clean run")
    part2 = out / "collapse"
    kw = dict(log=log, report=False, k=k, max_prompts=collapse_prompts)
    _, _, clean = run_sanity(collapse_cfg, part2, ["fp32"], ["grpo"], **kw)
    _, _, broken = run_sanity(collapse_cfg, part2, ["fp32"], ["grpo"], quantizations=[quantization], **kw)
    _, _, cured = run_sanity(collapse_cfg, part2, ["fp32"], ["grpo"], quantizations=[quantization], variant=CURE, **kw)
    trio = [clean[0], broken[0], cured[0]]
    labels = ["clean: fp32 rollout", f"{quantization} rollout, GRPO", f"{quantization} rollout + quantization_aware"]
    headline = _headline(trio, quantization)
    wall = {"part 1": t1 - t0, "part 2": time.perf_counter() - t1}
    report = write_demo_report(out, prec_dirs, trio, labels, headline, precision_cfg, collapse_cfg, wall)
    arms = [summarize(d) for d in prec_dirs + trio]
    for s, lab in zip(arms[len(prec_dirs):], labels):  # part 2's fp32 run is not part 1's: say which is which
        s["arm"] = lab
    return {"report": report, "headline": headline, "arms": arms, "wall_s": time.perf_counter() - t0}


def _tail(rows, key="reward/mean", n=10):
    xs = [r[key] for r in rows[-n:] if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(xs) / len(xs) if xs else float("nan")


def _headline(trio, quantization) -> str:
    from unison.data_io import read_metrics

    rows = [read_metrics(d / "metrics.jsonl") for d in trio]
    clean, broken, cured = (_tail(r) for r in rows)
    start = _tail(rows[1][:10])
    ledger = [r for r in rows[1] if "ledger/quantization_k3" in r]
    share = ""
    if ledger:
        last = ledger[-1]
        terms = [k for k in last if k.startswith("ledger/") and k.endswith("_k3") and k != "ledger/total_k3"]
        tot = sum(max(last[k], 0.0) for k in terms) or 1.0
        share = f"; the ledger put {100 * max(last['ledger/quantization_k3'], 0.0) / tot:.0f}% of its mismatch on quantization"
    return (f"{quantization} rollout weights: GRPO went from {start:.2f} to {broken:.2f} training accuracy (last 10 steps)"
            f"{share}; the same run with train.quantization_aware=true reached {cured:.2f}, the clean run {clean:.2f}: "
            f"{_verdict(start, broken, cured, clean, quantization)}")


def _verdict(start: float, broken: float, cured: float, clean: float, quantization: str = "int4") -> str:
    """What part 2 showed. A collapse is a run that fell (ends below where it started) and ends under 95% of the
    clean run; only then can the cure be judged: it cured it if it ends at 95% of the clean run or above."""
    if not (broken < start and broken < 0.95 * clean):
        how = "rose" if broken >= start else "ended within 5% of the clean run"
        return (f"here the {quantization} run did not collapse (it {how}; the collapse is one seed's path, "
                f"docs/experiments/cures.md has 3 seeds), so this run cannot show the cure")
    cure = "cured it" if cured >= 0.95 * clean else "did not cure it"
    return f"computing the learner through the rollout's quantizer {cure}"


def write_demo_report(out: Path, prec_dirs, trio, labels, headline: str, cfg1: Config, cfg2: Config,
                      wall: dict) -> Path:
    from unison.data_io import atomic_write_text, read_metrics
    from unison.plots import demo_plot, ledger_plot
    from unison.report import markdown_table, summarize

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    series = [(lab, read_metrics(d / "metrics.jsonl")) for lab, d in zip(labels, trio)]
    curves, led = demo_plot(series, plots), ledger_plot(series, plots)
    prec = [summarize(d) for d in prec_dirs]
    cure = [summarize(d) for d in trio]
    for s, lab in zip(cure, labels):
        s["arm"] = lab

    def recipe(c):
        return (f"{c.task.name}, {c.train.prompts_per_step} prompts × {c.rollout.n} samples per step, "
                f"{c.train.mini_batches} mini-batch{'es' if c.train.mini_batches > 1 else ''}, lr {c.train.lr}, "
                f"{c.train.steps} steps, seed {c.seed}")

    lines = ["# unison demo", "", headline + ".", "",
             f"Wall time: part 1 {wall['part 1'] / 60:.1f} min, part 2 {wall['part 2'] / 60:.1f} min (SFT warm starts "
             f"and perfectible sets included; rerunning reuses them).", "",
             f"## 1. Precision: the mismatch each precision causes ({recipe(cfg1)})", "", markdown_table(prec), "",
             f"## 2. A run that collapses, and the same run cured ({recipe(cfg2)})", "", markdown_table(cure), "",
             f"![curves]({curves.relative_to(out)})", ""]
    if led:
        lines += ["Where each run's mismatch came from (the mismatch ledger, docs/ledger.md): the mean k3 of each term "
                  "over the run's ledger steps, and its share of their sum:", "",
                  *ledger_table([(s["arm"], d) for s, d in zip(prec + cure, [*prec_dirs, *trio])]), "",
                  f"![ledger]({led.relative_to(out)})", ""]
    lines += ["Runs: " + ", ".join(f"`{d}`" for d in [*prec_dirs, *trio]), ""]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return out / "report.md"


def ledger_table(runs) -> list[str]:
    """Markdown rows: per run, the mean ``ledger/<term>_k3`` over its ledger steps and each term's share."""
    from unison.data_io import read_metrics
    from unison.ledger import TERMS

    rows, used = [], []
    for name, d in runs:
        logged = [r for r in read_metrics(d / "metrics.jsonl") if "ledger/total_k3" in r]
        if not logged:
            continue
        means = {t: sum(r[f"ledger/{t}_k3"] for r in logged) / len(logged)
                 for t in TERMS if all(f"ledger/{t}_k3" in r for r in logged)}
        used += [t for t in means if t not in used]
        rows.append((name, len(logged), sum(r["ledger/total_k3"] for r in logged) / len(logged), means))
    if not rows:
        return ["(no ledger step)"]
    terms = [t for t in TERMS if t in used]
    out = ["| run | ledger steps | mean total k3 | " + " | ".join(terms) + " |",
           "| --- | --- | --- | " + " | ".join("---" for _ in terms) + " |"]
    for name, n, total, means in rows:
        tot = sum(max(v, 0.0) for v in means.values()) or 1.0
        out.append(f"| {name} | {n} | {total:.2e} | " + " | ".join(
            f"{means[t]:.2e} ({100 * max(means[t], 0.0) / tot:.0f}%)" if t in means else "–" for t in terms) + " |")
    return out
