"""The SmolLM2 block of docs/experiments/distillation.md from run_distill.sh's runs (runs/smollm2_stale/distill-*):
per arm and seed the training accuracy (first and last 10 steps), the steps to 80% of the teacher's accuracy and to
0.8 (5-step moving average), and the student's reverse KL to the teacher on its own samples (first and last 3
steps). Writes the page's block between ``<!-- smollm2-distill: begin -->`` and ``<!-- smollm2-distill: end -->``.

    python experiments/smollm2/analyze_distill.py runs/smollm2_stale docs/experiments/distillation.md
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from analyze import md_table, mean, series, steps_to  # noqa: E402  (experiments/analyze.py)

from unison.data_io import read_metrics  # noqa: E402

ARMS = {"grpo": "GRPO (the task's reward; the teacher's KL logged, coef 0)",
        "opd_sampled": "OPD, sampled estimator (per-token advantage, no task reward)",
        "opd_full": "OPD, full estimator (exact reverse KL over 49k tokens, no task reward)"}
TEACHER = "clean-lr1e-5-s0"  # the clean GRPO run of run_precision.sh / run_stale.sh: its step-60 model


def rows(runs: Path) -> tuple[float, list[list[str]]]:
    teacher = mean(series(read_metrics(runs / TEACHER / "metrics.jsonl"), "reward/mean")[-10:])
    out = []
    for arm, label in ARMS.items():
        for run in sorted(p for p in runs.glob(f"distill-{arm}-s*") if (p / "metrics.jsonl").exists()):
            m = read_metrics(run / "metrics.jsonl")
            rw, kl = series(m, "reward/mean"), series(m, "distill/reverse_kl_mu")
            seed = run.name.rsplit("-s", 1)[1]
            fmt = lambda v: "–" if v is None else str(v)  # noqa: E731
            out.append([label, seed, str(len(m)), f"{mean(rw[:10]):.3f}", f"{mean(rw[-10:]):.3f}",
                        fmt(steps_to(rw, 0.8 * teacher)), fmt(steps_to(rw, 0.8)),
                        f"{mean(kl[:3]):.3f} → {mean(kl[-3:]):.3f}"])
    return teacher, out


def main(runs: Path, page: Path) -> None:
    teacher, table = rows(runs)
    head = ["arm", "seed", "steps", "acc first 10", "acc last 10", f"steps to 80% of the teacher ({0.8 * teacher:.2f})",
            "steps to 0.80", "reverse KL to the teacher (first 3 → last 3)"]
    start, end = "<!-- smollm2-distill: begin -->", "<!-- smollm2-distill: end -->"
    intro = (HERE / "intro_distill.md").read_text().replace("TEACHER_ACC", f"{teacher:.3f}")
    block = "\n".join([start, "", intro.rstrip(), "", *md_table(head, table), "", end])
    text = page.read_text()
    text = (text[:text.index(start)] + block + text[text.index(end) + len(end):]) if start in text else \
        text.rstrip() + "\n\n" + block + "\n"
    page.write_text(text)
    print(f"wrote {page}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
