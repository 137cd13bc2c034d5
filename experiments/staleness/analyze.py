"""Tables and curves of experiments/staleness (issue 18), written to docs/experiments/.

    python experiments/staleness/analyze.py runs/staleness docs/experiments/staleness.md

Reads ``K{K}-{arm}/arms/*`` for K in 0, 1, 4 and the four anchors; prepends ``intro.md``.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analyze import collapse_step, ma, mean, pm, seed_curves, series  # noqa: E402

from unison.data_io import read_metrics  # noqa: E402

ARMS = {"naive": "naive (PPO-clip around the recomputed π_old, no weight)",
        "behave": "behave (PPO-clip around μ: AReaL's naive PPO)",
        "decoupled": "decoupled (recomputed π_old + token TIS: AReaL's decoupled PPO)",
        "dppo": "DPPO-Binary-TV around μ (prime-rl's default)",
        "lowlr": "naive at a 4× smaller LR (2.5e-5)"}
KS = (0, 1, 4)
WIN = 10


def summary(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    rw = series(rows, "reward/mean")
    return {"first": mean(rw[:WIN]), "last": mean(rw[-WIN:]), "best": max(x for x in ma(rw)[WIN - 1:] if math.isfinite(x)),  # full windows only
            "collapse": collapse_step(rw), "k3": mean(series(rows, "mismatch/k3")),
            "numeric": mean(series(rows, "mismatch/numeric_k3")), "stale_k3": mean(series(rows, "mismatch/staleness_k3")),
            "staleness": mean(series(rows, "staleness/mean")), "clip": mean(series(rows, "policy/clip_fraction")),
            "masked": mean(series(rows, "correction/masked_fraction")),
            "wall": sum(r.get("time/step_s") or 0 for r in rows), "rows": rows}


def load(root: Path) -> dict:
    out = {}
    for K in KS:
        for arm in ARMS:
            d = root / f"K{K}-{arm}" / "arms"
            if not d.is_dir():
                continue
            for run in sorted(d.iterdir()):
                m = re.search(r"-s(\d+)$", run.name)
                if (run / "metrics.jsonl").exists() and m:
                    out[(K, arm, int(m.group(1)))] = summary(run)
    return out


def main() -> None:
    root, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    img = out_md.parent / out_md.stem
    img.mkdir(parents=True, exist_ok=True)
    runs = load(root)
    intro = Path(__file__).with_name("intro.md")
    lines = [intro.read_text().strip(), ""] if intro.exists() else ["# Staleness", ""]
    head = ("| K | anchor | seeds | acc first 10 | acc last 10 (mean ± sd) | best 10-step | collapsed | mean staleness | "
            "token k3 | numeric k3 | staleness k3 | clip / mask fraction | weight 0 |")
    lines += ["## Per arm", "", head, "| " + " | ".join("---" for _ in head.split("|")[1:-1]) + " |"]
    for arm in ARMS:
        for K in KS:
            vs = [v for (k, a, s), v in sorted(runs.items()) if k == K and a == arm]
            if not vs:
                continue
            lines.append(f"| {K} | {arm} | {len(vs)} | {pm([v['first'] for v in vs])} | {pm([v['last'] for v in vs])} | "
                         f"{pm([v['best'] for v in vs])} | {sum(v['collapse'] is not None for v in vs)}/{len(vs)} | "
                         f"{statistics.mean(v['staleness'] for v in vs):.2f} | {statistics.mean(v['k3'] for v in vs):.2e} | "
                         f"{statistics.mean(v['numeric'] for v in vs):.2e} | {statistics.mean(v['stale_k3'] for v in vs):.2e} | "
                         f"{statistics.mean(v['clip'] for v in vs):.3f} | {statistics.mean(v['masked'] for v in vs):.3f} |")
    fig, axes = plt.subplots(1, len(ARMS), figsize=(5.2 * len(ARMS), 4.2), squeeze=False)
    for ax, arm in zip(axes[0], ARMS):
        for i, K in enumerate(KS):
            vs = [v for (k, a, s), v in sorted(runs.items()) if k == K and a == arm]
            if not vs:
                continue
            seed_curves(ax, vs, f"C{i}", f"K = {K}")
        ax.set_title(arm)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training accuracy (10-step mean)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "curves.png", dpi=90)
    plt.close(fig)
    lines += ["", "![curves](staleness/curves.png)", "", "## Every run", "",
              "| K | anchor | seed | acc first 10 | acc last 10 | best | collapse step | token k3 | numeric k3 | "
              "staleness k3 | wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (K, arm, s), v in sorted(runs.items(), key=lambda kv: (list(ARMS).index(kv[0][1]), kv[0][0], kv[0][2])):
        c = "–" if v["collapse"] is None else v["collapse"]
        lines.append(f"| {K} | {arm} | {s} | {v['first']:.3f} | {v['last']:.3f} | {v['best']:.3f} | {c} | {v['k3']:.2e} | "
                     f"{v['numeric']:.2e} | {v['stale_k3']:.2e} | {v['wall']:.0f} |")
    out_md.write_text("\n".join(lines) + "\n")
    print(out_md)


if __name__ == "__main__":
    main()
