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

#: the collapse-and-cure arms: (label, rollout weight format, config overrides, name suffix)
CURE = ("-qat", {"train": {"quantization_aware": True}})


def run_demo(cfg: Config, out: Path, precisions: list[str], log=lambda m: print(m, file=sys.stderr, flush=True),
             quantization: str = "int4", k: int = 8, max_prompts: int | None = 32) -> dict:
    """Run the demo's arms and write ``out/report.md``; returns its headline numbers."""
    from unison.report import summarize
    from unison.sanity import run_sanity

    if "fp32" not in precisions:
        raise UnisonError("the demo compares the collapse with the clean fp32 run: keep fp32 in --precisions")
    t0 = time.perf_counter()
    log("[demo] part 1/2: the same GRPO run once per precision")
    _, _, prec_dirs = run_sanity(cfg, out, precisions, ["grpo"], log=log, report=False, k=k, max_prompts=max_prompts)
    log(f"[demo] part 2/2: {quantization} rollout weights — GRPO, then the same run with a quantization-aware learner")
    _, _, broken = run_sanity(cfg, out, ["fp32"], ["grpo"], log=log, quantizations=[quantization], report=False,
                               k=k, max_prompts=max_prompts)
    _, _, cured = run_sanity(cfg, out, ["fp32"], ["grpo"], log=log, quantizations=[quantization], variant=CURE,
                             report=False, k=k, max_prompts=max_prompts)
    clean = next(d for d in prec_dirs if d.name == "fp32-grpo")
    trio = [clean, broken[0], cured[0]]
    labels = ["clean: fp32 rollout", f"{quantization} rollout, GRPO", f"{quantization} rollout + quantization_aware"]
    headline = _headline(trio, labels, quantization)
    report = write_demo_report(out, prec_dirs, trio, labels, headline, cfg, time.perf_counter() - t0)
    return {"report": report, "headline": headline, "arms": [summarize(d) for d in prec_dirs + trio[1:]],
            "wall_s": time.perf_counter() - t0}


def _tail(rows, key="reward/mean", n=10):
    xs = [r[key] for r in rows[-n:] if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(xs) / len(xs) if xs else float("nan")


def _headline(trio, labels, quantization) -> str:
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
    verdict = "cured it" if cured >= 0.95 * clean and broken < 0.95 * clean else \
        "did not cure it" if cured < 0.95 * clean else "— and here the int4 run did not collapse"
    return (f"{quantization} rollout weights: GRPO went from {start:.2f} to {broken:.2f} training accuracy (last 10 steps)"
            f"{share}; the same run with train.quantization_aware=true reached {cured:.2f}, the clean run {clean:.2f}: "
            f"computing the learner through the rollout's quantizer {verdict}")


def write_demo_report(out: Path, prec_dirs, trio, labels, headline: str, cfg: Config, wall_s: float) -> Path:
    from unison.data_io import atomic_write_text
    from unison.plots import demo_plot, ledger_plot
    from unison.report import markdown_table, summarize

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    from unison.data_io import read_metrics

    curves = demo_plot([(lab, read_metrics(d / "metrics.jsonl")) for lab, d in zip(labels, trio)], plots)
    led = ledger_plot([(lab, read_metrics(d / "metrics.jsonl")) for lab, d in zip(labels, trio)], plots)
    prec = [summarize(d) for d in prec_dirs]
    cure = [summarize(d) for d in trio]
    for s, lab in zip(cure, labels):
        s["arm"] = lab
    lines = ["# unison demo", "", headline + ".", "",
             f"Built-in tiny model after a supervised warm start on {cfg.task.name}; the same GRPO configuration and seed "
             f"({cfg.seed}) in every arm; {cfg.train.prompts_per_step} prompts × {cfg.rollout.n} samples per step, "
             f"{cfg.train.steps} steps, lr {cfg.train.lr}. Wall time {wall_s / 60:.1f} min.", "",
             "## 1. Precision: what the mismatch is (Paper A's sanity test)", "", markdown_table(prec), "",
             "## 2. A run that collapses, and the same run cured", "", markdown_table(cure), "",
             f"![curves]({curves.relative_to(out)})", ""]
    if led:
        lines += ["Where each run's mismatch came from (the mismatch ledger, docs/ledger.md):", "",
                  f"![ledger]({led.relative_to(out)})", ""]
    lines += ["Runs: " + ", ".join(f"`{d}`" for d in [*prec_dirs, *trio[1:]]), ""]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return out / "report.md"
