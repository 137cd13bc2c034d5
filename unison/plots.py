"""Plots (matplotlib, Agg backend: files only, no screen)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from unison.data_io import read_metrics  # noqa: E402
from unison.ledger import TERMS


def probe_plots(results: list[dict], samples: list[dict], plot_dir: Path) -> list[Path]:
    """π-vs-μ token-probability scatter per arm, and sequence log-ratio against length."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    k = len(samples)
    fig, axes = plt.subplots(1, k, figsize=(4.2 * k, 4.2), squeeze=False)
    for ax, s, r in zip(axes[0], samples, results):
        ax.scatter(s["p_mu"], s["p_pi"], s=3, alpha=0.4, rasterized=True)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("μ(y_t)  rollout engine")
        ax.set_ylabel("π(y_t)  learner")
        ax.set_title(f"{s['engine']}/{s['precision']}  k3={r['mismatch/k3']:.2g}\n"
                     f"mean |π−μ|={r['mismatch/prob_diff_mean']:.2g}", fontsize=9)
    fig.suptitle("sampled-token probabilities: learner vs rollout engine")
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "token_probs_scatter.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for s, r in zip(samples, results):
        x = np.asarray(s["lengths"], dtype=float)
        y = np.asarray(s["seq_log_ratio"], dtype=float)
        sc = ax.scatter(x, y, s=10, alpha=0.6, label=f"{s['engine']}/{s['precision']}")
        slope = r.get("seq_log_ratio_slope_per_1k")
        if slope is not None and len(x) > 1:
            xs = np.linspace(x.min(), x.max(), 20)
            b = y.mean() - slope / 1000 * x.mean()
            ax.plot(xs, b + slope / 1000 * xs, color=sc.get_facecolor()[0], lw=1.5,
                    label=f"fit: {slope:+.3g} per 1K tokens")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("log π(y) − log μ(y)")
    ax.set_title("sequence log-ratio against response length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, plot_dir / "seq_log_ratio_vs_length.png"))
    located = [(r["locate"]["arm"], r["locate"]) for r in results if r.get("locate")]
    if located:
        paths.append(locate_plot(located, plot_dir))
    return paths


def locate_plot(located: list[tuple[str, dict]], plot_dir: Path) -> Path:
    """``probe --locate``: each arm's relative error op by op (its rounding line dashed, the first op above it
    marked), and the full-vocabulary KL(μ ‖ π) by position in the response."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [2.2, 1]})
    for label, loc in located:
        ops = loc["ops"]
        err = np.asarray([max(o["rel_error"], 1e-12) for o in ops])
        line, = ax.plot(np.arange(len(ops)), err, lw=1.2, marker=".", ms=3, label=f"{label} (line {loc['rounding_line']:.1g})")
        ax.axhline(loc["rounding_line"], color=line.get_color(), lw=0.8, ls="--")
        if loc["first_above"] is not None:
            i = [o["op"] for o in ops].index(loc["first_above"])
            ax.annotate(loc["first_above"], (i, err[i]), textcoords="offset points", xytext=(4, 6), fontsize=8,
                        color=line.get_color())
            ax.plot([i], [err[i]], marker="o", ms=6, mfc="none", color=line.get_color())
        kl = np.asarray(loc["full_kl_by_position"], dtype=float)
        bx.plot(np.arange(len(kl)), np.maximum(kl, 1e-12), lw=1.2, label=label)
    names = [o["op"] for o in located[0][1]["ops"]]
    ticks = [i for i, n in enumerate(names) if not n.startswith("L") or n.endswith(".out")]
    step = max(1, len(ticks) // 16)
    ax.set_xticks([ticks[i] for i in range(0, len(ticks), step)])
    ax.set_xticklabels([names[ticks[i]] for i in range(0, len(ticks), step)], rotation=60, fontsize=7)
    ax.set_yscale("log"), bx.set_yscale("log")
    ax.set_ylabel("‖h_engine − h_learner‖ / ‖h_learner‖")
    ax.set_title("where the engine and the learner part (dashed: 4 unit roundoffs of the engine's dtype)", fontsize=9)
    ax.legend(fontsize=7), ax.grid(alpha=0.3)
    bx.set_xlabel("position in the response"), bx.set_ylabel("KL(μ ‖ π), full vocabulary")
    bx.set_title("full-vocabulary KL by position", fontsize=9)
    bx.legend(fontsize=7), bx.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, plot_dir / "locate.png")


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


RUN_PANELS = [
    ("reward/mean", "training reward"),
    ("mismatch/k3", "token k3 (μ‖π)"),
    ("mismatch/prob_diff_mean", "|π − μ|: mean (solid), max (dashed)"),
    ("response_length/mean", "response length"),
    ("optim/lr", "learning rate"),
    ("optim/loss_scale", "loss scale"),
    ("grad_noise/noise_scale_ema", "gradient noise scale (EMA)"),
    ("policy/entropy", "policy entropy"),
]
LOG_PANELS = ("mismatch/k3", "mismatch/prob_diff_mean", "optim/loss_scale", "grad_noise/noise_scale_ema")


def run_plots(run_dirs, out_dir: Path | None = None, labels: list[str] | None = None) -> list[Path]:
    """Curves against step for one or more run directories, overlaid: an overview grid
    (reward, token k3, mean and max |π − μ|, response length, LR, loss scale).
    Written to ``out_dir`` (default: the first run's ``plots/``)."""
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [Path(run_dirs)]
    run_dirs = [Path(d) for d in run_dirs]
    labels = labels or [d.name for d in run_dirs]
    out_dir = Path(out_dir) if out_dir else run_dirs[0] / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    series = []
    for d, label in zip(run_dirs, labels):
        rows = read_metrics(d / "metrics.jsonl")
        series.append((label, rows))
    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    for ax, (key, title) in zip(axes.flat, RUN_PANELS):
        for i, (label, rows) in enumerate(series):
            color = f"C{i}"
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:  # few points get markers: a single step is a dot, not a vertical line
                ax.plot(*zip(*pts), label=label, lw=1.3, color=color, marker="o" if len(pts) <= 3 else None, ms=4)
            if key == "mismatch/prob_diff_mean":
                mx = [(r["step"], r["mismatch/prob_diff_max"]) for r in rows
                      if isinstance(r.get("mismatch/prob_diff_max"), (int, float))]
                if mx:
                    ax.plot(*zip(*mx), lw=0.9, ls="--", color=color)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged in these runs", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
        if key in LOG_PANELS and any((r.get(key) or 0) > 0 for _, rows in series for r in rows):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    paths = [_save(fig, out_dir / "training_curves.png")]
    ledger = ledger_plot(series, out_dir)
    return paths + ([ledger] if ledger else [])


def ledger_plot(series: list[tuple[str, list[dict]]], out_dir: Path) -> Path | None:
    """The mismatch ledger of each run that has one: every term's share of Σk3, stacked, per logged step, with
    the total token k3 on a second axis (unison/ledger.py). None when no run logged a ledger."""
    runs = [(label, [r for r in rows if "ledger/total_k3" in r]) for label, rows in series]
    runs = [(label, rows) for label, rows in runs if rows]
    if not runs:
        return None
    n = len(runs)
    cols = min(n, 3)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(5.5 * cols, 3.6 * ((n + cols - 1) // cols)),
                             squeeze=False)
    colors = {t: f"C{i}" for i, t in enumerate(TERMS)}
    for ax, (label, rows) in zip(axes.flat, runs):
        steps = [r["step"] for r in rows]
        terms = [t for t in TERMS if any(f"ledger/{t}_k3" in r for r in rows)]
        vals = np.array([[max(r.get(f"ledger/{t}_k3") or 0.0, 0.0) for r in rows] for t in terms])
        tot = vals.sum(0)
        shares = np.divide(vals, tot, out=np.zeros_like(vals), where=tot > 0) * 100
        ax.stackplot(steps, shares, labels=terms, colors=[colors[t] for t in terms], alpha=0.85)
        ax.set_ylim(0, 100)
        ax.set_ylabel("share of Σk3 (%)")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax2 = ax.twinx()
        ax2.plot(steps, [r["ledger/total_k3"] for r in rows], color="black", lw=1.2, marker="o", ms=3,
                 label="total token k3")
        if any(r["ledger/total_k3"] > 0 for r in rows):
            ax2.set_yscale("log")
        ax2.set_ylabel("total k3")
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("mismatch ledger: where each logged step's mismatch comes from")
    fig.tight_layout()
    return _save(fig, out_dir / "ledger.png")


def demo_plot(series: list[tuple[str, list[dict]]], out_dir: Path, per_color: int = 1) -> Path:
    """``unison demo``: the training accuracy of the clean, the collapsing and the cured run in one plot (5-step
    mean), and their token k3 beside it. ``per_color``: consecutive series sharing a colour (one run's seeds,
    told apart by the line style)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = ["-", "--", ":", "-."]
    for j, (label, rows) in enumerate(series):
        i, ls = j // per_color, styles[j % per_color % len(styles)]
        pts = [(r["step"], r["reward/mean"]) for r in rows if isinstance(r.get("reward/mean"), (int, float))]
        if not pts:
            continue
        steps, vals = zip(*pts)
        smooth = [float(np.mean(vals[max(0, j - 4):j + 1])) for j in range(len(vals))]
        ax.plot(steps, vals, color=f"C{i}", alpha=0.25, lw=0.8, ls=ls)
        ax.plot(steps, smooth, color=f"C{i}", lw=2, label=label, ls=ls)
        k3 = [(r["step"], r["mismatch/k3"]) for r in rows if isinstance(r.get("mismatch/k3"), (int, float))]
        if k3:
            ax2.plot(*zip(*k3), color=f"C{i}", lw=1.3, label=label, ls=ls)
    ax.set_xlabel("step")
    ax.set_ylabel("training accuracy (5-step mean)")
    ax.set_title("the same GRPO run: clean, broken by the mismatch, with its cure", fontsize=10)
    ax.legend(fontsize=8)
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_title("token k3 between the rollout engine (μ) and the learner (π)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_dir / "collapse_and_cure.png")
