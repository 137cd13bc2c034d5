"""The report of run_lift.sh (issue 52): does distillation lift a student, and which arm leads?

    python experiments/distillation/analyze_lift.py docs/experiments/distillation.md runs/distill_lift \
        runs/distill_lift_lr3e-3


Reads ``runs/distill_lift/<arm>-s<seed>/metrics.jsonl`` (every arm logs ``reward/mean``, the training reward of the
student's own samples, and ``distill/reverse_kl_pi``, the per-token reverse-KL estimate to the teacher on them) and
writes the page's block between ``<!-- lift: begin -->`` and ``<!-- lift: end -->``, one section per run root
with its curves (``docs/img/<root's name>.png``): per arm and seed the first and last 10 steps, the
step the student first reaches half the teacher's reward (10-step mean), and the mean over seeds per step.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARMS = {"grpo": "GRPO (the task's reward)", "opd_sampled": "OPD, sampled estimator (per-token advantage)",
        "opd_full": "OPD, full estimator (exact per-position reverse KL)",
        "sft_teacher": "SFT on the teacher's samples (off-policy distillation)"}
WIN = 10


def load(root: Path) -> dict[str, dict[int, list[dict]]]:
    out: dict[str, dict[int, list[dict]]] = {}
    for d in sorted(root.glob("*-s*")):
        m = re.match(r"^(.*)-s(\d+)$", d.name)
        if not m or m[1] not in ARMS or not (d / "summary.json").exists():
            continue
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        out.setdefault(m[1], {})[int(m[2])] = rows
    return out


def series(rows, key):
    return [r.get(key) if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]


def mean(xs):
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def pm(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return "–"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def first_reaching(rewards, level):
    for i in range(WIN, len(rewards) + 1):
        if mean(rewards[i - WIN:i]) >= level:
            return i
    return None


def teacher_reward(root: Path) -> float | None:
    """The teacher's training reward at T = 1 from its SFT summary (unison sft: eval accuracy, sampled)."""
    for name in ("sft.json", "summary.json"):
        p = root / "teacher" / name
        if p.exists():
            s = json.loads(p.read_text())
            for k in ("eval_sampled", "eval_accuracy_sampled", "accuracy_sampled", "eval/accuracy"):
                if isinstance(s.get(k), (int, float)):
                    return float(s[k])
    return None


def section(root: Path, page: Path) -> list[str]:
    """One run root's tables and curves: its LR and steps from the first run's config."""
    runs = load(root)
    teacher = teacher_reward(root)
    half = teacher / 2 if teacher else None
    lines = []
    lines += ["| arm | seed | reward first 10 | reward last 10 | reverse KL first 10 | reverse KL last 10 | "
              f"steps to half the teacher ({half:.3f}) |" if half else
              "| arm | seed | reward first 10 | reward last 10 | reverse KL first 10 | reverse KL last 10 | – |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    per_arm = {}
    for arm in ARMS:
        for seed, rows in sorted(runs.get(arm, {}).items()):
            rw, kl = series(rows, "reward/mean"), series(rows, "distill/reverse_kl_pi")
            reach = first_reaching(rw, half) if half else None
            per_arm.setdefault(arm, []).append((mean(rw[:WIN]), mean(rw[-WIN:]), mean(kl[:WIN]), mean(kl[-WIN:]), reach))
            lines.append(f"| {arm} | {seed} | {mean(rw[:WIN]):.3f} | {mean(rw[-WIN:]):.3f} | {mean(kl[:WIN]):.2f} | "
                         f"{mean(kl[-WIN:]):.2f} | {reach if reach else '–'} |")
    summary = ["| arm | seeds | reward last 10 | reverse KL last 10 (nats/token) | reached half the teacher |",
               "| --- | --- | --- | --- | --- |"]
    for arm, xs in per_arm.items():
        summary.append(f"| {ARMS[arm]} | {len(xs)} | {pm([x[1] for x in xs])} | {pm([x[3] for x in xs])} | "
                       f"{sum(x[4] is not None for x in xs)}/{len(xs)} |")
    img = (page.parent.parent / "img" if page.parent.name == "experiments" else page.parent) / f"{root.name}.png"
    img.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, label in ARMS.items():
        seeds = runs.get(arm, {})
        if not seeds:
            continue
        n = min(len(r) for r in seeds.values())
        for ax, key in zip(axes, ("reward/mean", "distill/reverse_kl_pi")):
            per = [series(r, key)[:n] for r in seeds.values()]
            avg = [mean([p[i] for p in per]) for i in range(n)]
            k = 5  # a 5-step moving average: the per-step reward of 128 samples is noisy
            smooth = [mean(avg[max(0, i - k + 1):i + 1]) for i in range(n)]
            ax.plot(range(1, n + 1), smooth, label=label)
    axes[0].set(xlabel="step", ylabel="training reward (5-step mean)", title="reward of the student's own samples")
    if teacher:
        axes[0].axhline(teacher, color="k", ls="--", lw=0.8, label=f"teacher ({teacher:.2f})")
    axes[1].set(xlabel="step", ylabel="nats / token", title="reverse KL to the teacher (k1, student's samples)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(img, dpi=110)
    plt.close(fig)
    first = next((r for seeds in runs.values() for r in seeds.values()), [])
    lr = next((r[0]["optim/lr"] for seeds in runs.values() for r in seeds.values() if "optim/lr" in r[0]), None)
    title = f"### LR {lr:.0e}, {len(first)} steps (`runs/{root.name}`)" if isinstance(lr, float) else f"### `runs/{root.name}`"
    return [title, "", *summary, "", "Every run (10-step means):", "", *lines, "",
            f"![reward and reverse KL per step, mean of the seeds, {root.name}](../img/{img.name})", ""]


def main(page: Path, roots: list[Path]) -> Path:
    text = page.read_text() if page.exists() else ""
    start, end = "<!-- lift: begin -->", "<!-- lift: end -->"
    block = "\n".join([start, "", *(x for r in roots for x in section(r, page)), end])
    if start in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text + "\n" + block + "\n"
    page.write_text(text)
    return page


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: analyze_lift.py PAGE RUNS [RUNS ...]")
    print(main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]]))
