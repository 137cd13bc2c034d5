"""docs/experiments/distillation.md from runs/distillation/: the shared tables and curves
(experiments/analyze.py), the distillation signal per run, and accuracy against wall time.

    python experiments/distillation/analyze.py runs/distillation docs/experiments/distillation.md [SELF_DIR]

SELF_DIR (default runs/distill_smollm2_self, from experiments/distillation/smollm2_self.sh): SmolLM2 as its own
teacher, one table per step, when it is there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from unison.data_io import read_metrics  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from analyze import insert_before_plots, md_table, run_dirs  # noqa: E402  (experiments/analyze.py)

KEYS = ("distill/reverse_kl_pi", "distill/reverse_kl_mu", "distill/mismatch_share")


def signal_rows(root: Path) -> list[str]:
    head = ["run", *[f"{k.split('/')[1]} first 5 → last 5" for k in KEYS], "teacher time / step", "wall time"]
    out = []
    for run in run_dirs(root):
        rows = read_metrics(run / "metrics.jsonl")

        def span(key):
            xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if not xs:
                return "–"
            a, b = xs[:5], xs[-5:]
            return f"{sum(a) / len(a):.3g} → {sum(b) / len(b):.3g}"
        teacher = [r.get("time/teacher_s") for r in rows if r.get("time/teacher_s") is not None]
        wall = sum(r.get("time/step_s") or 0 for r in rows)
        out.append([run.name, *[span(k) for k in KEYS], f"{sum(teacher) / len(teacher):.2f} s" if teacher else "–",
                    f"{wall:.0f} s"])
    return md_table(head, out)


def wall_plot(root: Path, img: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {}
    for run in run_dirs(root):
        arm = re.sub(r"-s\d+$", "", run.name)
        c = colors.setdefault(arm, f"C{len(colors)}")
        rows = read_metrics(run / "metrics.jsonl")
        t, x = 0.0, []
        for r in rows:
            t += r.get("time/step_s") or 0
            x.append(t)
        ax.plot(x, [r.get("reward/mean") for r in rows], color=c, alpha=0.6, lw=1,
                label=arm if arm not in [h.get_label() for h in ax.lines] else None)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training reward")
    ax.legend()
    fig.tight_layout()
    path = img / "reward_vs_wall.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


SELF_ARMS = {"bf16": "student bf16 in both engines (μ and π_old), teacher fp32",
             "bf16-rollout": "student sampler bf16, learner fp32 (π_old in the teacher's numerics), teacher fp32"}


def self_teacher_rows(root: Path) -> list[str]:
    """SmolLM2 as its own teacher: per arm and step, the reverse KL from π_old (trained on) and from μ, the
    mismatch's share of the μ recipe's signal, the ledger's teacher term and the sampler's token k3."""
    head = ["arm", "step", "reverse_kl_pi", "reverse_kl_mu", "mismatch_share", "ledger teacher k3",
            "token k3 (μ vs π_old)", "teacher time"]
    out = []
    for arm, what in SELF_ARMS.items():
        path = root / arm / "metrics.jsonl"
        if not path.exists():
            continue
        for r in read_metrics(path):
            out.append([f"{arm}: {what}" if r["step"] == 1 else "", str(r["step"]),
                        f"{r['distill/reverse_kl_pi']:.3g}", f"{r['distill/reverse_kl_mu']:.3g}",
                        f"{r['distill/mismatch_share']:.3g}",
                        f"{r['ledger/teacher_k3']:.2g}" if "ledger/teacher_k3" in r else "–",
                        f"{r['mismatch/k3']:.2g}", f"{r['time/teacher_s']:.0f} s"])
    return md_table(head, out) if out else []


def main() -> None:
    root, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    subprocess.run([sys.executable, str(HERE.parent / "analyze.py"), str(root), str(out_md), "--title",
                    "On-policy distillation vs GRPO from a weak start", "--intro", str(HERE / "intro.md")],
                   check=True)
    wall = wall_plot(root, out_md.parent / out_md.stem)
    lines = ["## The distillation signal (student term from π_old, as trained, and from μ)", "",
             *signal_rows(root), "", f"![reward vs wall time]({out_md.stem}/{wall.name})", ""]
    self_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("runs/distill_smollm2_self")
    rows = self_teacher_rows(self_dir)
    if rows:
        lines = ["## SmolLM2 as its own teacher (the mismatch columns)", "",
                 (HERE / "smollm2_self.md").read_text().rstrip(), "", *rows, ""] + lines
    insert_before_plots(out_md, lines)
    print(out_md)


if __name__ == "__main__":
    main()
