"""Tables and plots for the experiments under experiments/: one row per arm and seed, curves
per arm (mean over seeds, each seed thin), written as Markdown + PNG under docs/experiments/.

    python experiments/analyze.py RUNS_DIR OUT_MD --title "..." [--group-by precision|schedule] [--intro FILE]

RUNS_DIR holds run directories (``unison sanity``'s ``arms/`` or ``unison train`` outputs) whose
names end in ``-s<seed>``; the arm is the name without it.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from unison.data_io import read_metrics  # noqa: E402

WIN = 10


def ma(xs, w=WIN):
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - w + 1):i + 1] if x is not None and math.isfinite(x)]
        out.append(sum(win) / len(win) if win else float("nan"))
    return out


def series(rows, key):
    return [r.get(key) if isinstance(r.get(key), (int, float)) else float("nan") for r in rows]


def collapse_step(rewards) -> int | None:
    """First step where the 10-step mean falls below half of its best so far, once the best was ≥ 0.3."""
    best = 0.0
    for i, m in enumerate(ma(rewards)):
        if not math.isfinite(m):
            continue
        if best >= 0.3 and m < 0.5 * best:
            return i + 1
        best = max(best, m)
    return None


def steps_to(rewards, level) -> int | None:
    for i, m in enumerate(ma(rewards, 5)):
        if i >= 4 and m >= level:
            return i + 1
    return None


def mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def seed_curves(ax, runs: list[dict], color: str, label: str) -> None:
    """One arm on ``ax``: each seed's 10-step mean of the training reward, faint, and their mean, bold
    (``runs``: summaries with the metric ``rows``)."""
    cs = [series(v["rows"], "reward/mean") for v in runs]
    n = min(len(c) for c in cs)
    for c in cs:
        ax.plot(range(1, n + 1), ma(c[:n]), color=color, alpha=0.2, lw=0.8)
    ax.plot(range(1, n + 1), ma([mean([c[j] for c in cs]) for j in range(n)]), color=color, lw=2, label=label)


def pm(xs) -> str:
    """Mean ± sample sd over the finite values ("–" when none)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "–"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def summarize(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    rw = series(rows, "reward/mean")
    k3 = series(rows, "mismatch/k3")
    seq = series(rows, "mismatch/seq_kl_k3")
    length = series(rows, "response_length/mean")
    ppo = series(rows, "policy/ppo_kl_k3")
    first, last = rows[:WIN], rows[-WIN:]
    return {
        "steps": len(rows), "acc_first": mean(rw[:WIN]), "acc_final": mean(rw[-WIN:]), "acc_max10": max(ma(rw)),
        "steps_to_80": steps_to(rw, 0.8), "steps_to_95": steps_to(rw, 0.95),
        "k3_mean": mean(k3), "k3_final": mean(k3[-WIN:]), "seq_kl_k3_mean": mean(seq),
        "len_first": mean(series(first, "response_length/mean")), "len_final": mean(series(last, "response_length/mean")),
        "len_max10": max(ma(length)), "collapse": collapse_step(rw),
        # the mismatch against how far each update moves the policy: KL(μ‖π_old) per token vs KL(π_old‖π_θ)
        "mismatch_over_update": mean([a / b for a, b in zip(k3, ppo) if b and b > 0 and math.isfinite(a)]),
        "noise_scale": mean(series(rows, "grad_noise/noise_scale_ema")),
        "lr_final": rows[-1].get("optim/lr"), "surge_step": rows[-1].get("lr_schedule/surge_step"),
        "wall_s": sum(r.get("time/step_s") or 0 for r in rows),
    }


def run_dirs(root: Path) -> list[Path]:
    """The run directories under ``root`` (those with a metrics.jsonl), sorted by name."""
    return sorted(p for p in Path(root).iterdir() if (p / "metrics.jsonl").exists())


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |",
            *["| " + " | ".join(r) + " |" for r in rows]]


def ledger_rows(runs: Path) -> list[str]:
    """One row per run: every ledger term's k1 averaged over the steps that measured it, the total, and
    the run's wall time."""
    found = []
    for run in run_dirs(runs):
        rows = read_metrics(run / "metrics.jsonl")
        measured = [r for r in rows if "ledger/total_k1" in r]
        terms = sorted({k[len("ledger/"):-len("_k1")] for r in measured for k in r
                        if k.startswith("ledger/") and k.endswith("_k1") and k != "ledger/total_k1"})
        found.append((run.name, measured, terms, sum(r.get("time/step_s") or 0 for r in rows), len(rows)))
    terms = sorted({t for _, _, ts, _, _ in found for t in ts})
    head = ["run", "ledger steps", *[f"{t} k1" for t in terms], "total k1", "total k3", "steps", "wall time"]
    out = []
    for name, measured, _, wall, n in found:
        def avg(key):
            xs = [r[key] for r in measured if isinstance(r.get(key), (int, float))]
            return f"{sum(xs) / len(xs):.2e}" if xs else "–"
        out.append([name, ",".join(str(r["step"]) for r in measured), *[avg(f"ledger/{t}_k1") for t in terms],
                    avg("ledger/total_k1"), avg("ledger/total_k3"), str(n), f"{wall / 60:.1f} min"])
    return md_table(head, out)


def insert_before_plots(out_md: Path, lines: list[str]) -> None:
    """Put ``lines`` into a report this script wrote, before its plots."""
    text = out_md.read_text()
    cut = text.index("![")
    out_md.write_text(text[:cut] + "\n".join(lines) + "\n" + text[cut:])


def fmt(v, f):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f.format(v)


COLS = [("arm", "arm", "{}"), ("seed", "seed", "{}"), ("acc first 10", "acc_first", "{:.3f}"),
        ("acc last 10", "acc_final", "{:.3f}"), ("best 10-step acc", "acc_max10", "{:.3f}"),
        ("steps to 80%", "steps_to_80", "{}"), ("steps to 95%", "steps_to_95", "{}"),
        ("mean k3", "k3_mean", "{:.2e}"), ("final k3", "k3_final", "{:.2e}"), ("seq KL (Σk3)", "seq_kl_k3_mean", "{:.2e}"),
        ("len first→last", "len", "{}"), ("collapse step", "collapse", "{}"),
        ("k3 / update KL", "mismatch_over_update", "{:.2e}")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("out_md")
    ap.add_argument("--title", default="experiment")
    ap.add_argument("--intro", default=None, help="a Markdown file placed before the tables")
    ap.add_argument("--extra-cols", default="", help="comma-separated extra columns: lr,surge,noise")
    args = ap.parse_args()
    runs = sorted(p for p in Path(args.runs).iterdir() if (p / "metrics.jsonl").exists())
    arms: dict[str, list[tuple[int, Path]]] = {}
    for r in runs:
        m = re.match(r"(.*)-s(\d+)$", r.name)
        arm, seed = (m.group(1), int(m.group(2))) if m else (r.name, 0)
        arms.setdefault(arm, []).append((seed, r))
    out_md = Path(args.out_md)
    img = out_md.parent / out_md.stem
    img.mkdir(parents=True, exist_ok=True)
    cols = list(COLS)
    extra = [c for c in args.extra_cols.split(",") if c]
    if "lr" in extra:
        cols += [("final LR", "lr_final", "{:.2e}"), ("surge step", "surge_step", "{}")]
    if "noise" in extra:
        cols += [("grad-noise scale", "noise_scale", "{:.3g}")]
    lines = [f"# {args.title}", ""]
    if args.intro:
        lines += [Path(args.intro).read_text().strip(), ""]
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    lines += ["## Every run", "", head, "| " + " | ".join("---" for _ in cols) + " |"]
    per_arm = {}
    for arm, seeded in arms.items():
        sums = []
        for seed, run in sorted(seeded):
            s = summarize(run)
            s.update(arm=arm, seed=seed, len=f"{s['len_first']:.1f}→{s['len_final']:.1f}")
            s["surge_step"] = None if s["surge_step"] in (None, -1) else s["surge_step"]
            sums.append(s)
            lines.append("| " + " | ".join(fmt(s[k], f) for _, k, f in cols) + " |")
        per_arm[arm] = sums
    lines += ["", "## Per arm (mean over seeds)", "",
              "| arm | seeds | acc last 10 | best 10-step acc | mean k3 | seq KL (Σk3) | len last 10 | collapsed (10-step mean < ½ of its best, a best ≥ 0.3) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, sums in per_arm.items():
        accs = [s["acc_final"] for s in sums]
        sd = f" ± {statistics.stdev(accs):.3f}" if len(accs) > 1 else ""
        lines.append(f"| {arm} | {len(sums)} | {mean(accs):.3f}{sd} | {mean([s['acc_max10'] for s in sums]):.3f} | "
                     f"{mean([s['k3_mean'] for s in sums]):.2e} | {mean([s['seq_kl_k3_mean'] for s in sums]):.2e} | "
                     f"{mean([s['len_final'] for s in sums]):.1f} | "
                     f"{sum(s['collapse'] is not None for s in sums)}/{len(sums)} |")
    plots = _plots(arms, img)
    lines += ["", *[f"![{p.stem}]({out_md.stem}/{p.name})" for p in plots], ""]
    out_md.write_text("\n".join(lines) + "\n")
    print(out_md)


def _plots(arms, img: Path) -> list[Path]:
    keys = [("reward/mean", "training reward (10-step mean)", True), ("mismatch/k3", "token k3 (log)", False),
            ("mismatch/seq_kl_k3", "sequence KL, Σ k3 (log)", False),
            ("mismatch/prob_diff_mean", "mean |π − μ| (log)", False),
            ("response_length/mean", "response length", True), ("optim/lr", "learning rate", True)]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title, linear) in zip(axes.flat, keys):
        for ci, (arm, seeded) in enumerate(sorted(arms.items())):
            curves = [series(read_metrics(r / "metrics.jsonl"), key) for _, r in sorted(seeded)]
            n = min(len(c) for c in curves)
            for c in curves:
                ax.plot(range(1, n + 1), ma(c[:n], WIN if key == "reward/mean" else 1), color=colors[ci % 10],
                        alpha=0.25, lw=0.8)
            avg = [mean([c[i] for c in curves]) for i in range(n)]
            ax.plot(range(1, n + 1), ma(avg, WIN if key == "reward/mean" else 3), color=colors[ci % 10], lw=2,
                    label=arm)
        ax.set_title(title)
        ax.set_xlabel("step")
        if not linear:
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path = img / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    main()
