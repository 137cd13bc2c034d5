"""Tables and curves of experiments/quantized_rollout (issue 19), written to docs/experiments/.

    python experiments/quantized_rollout/analyze.py runs/quantized_rollout docs/experiments/quantized_rollout.md

Reads the pilot (``pilot/arms``), the grid (``grid/arms``) and the two Paper B stages
(``surge_length/arms``, ``surge_mismatch/arms``); prepends ``intro.md`` (the question, the setup and
what was found, written from these numbers).
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

ALGOS = ["grpo", "grpo_token_tis", "grpo_seq_mis", "gspo", "pg_seq_is", "pg_seq_mis"]
QUANTS = ["none", "int8", "fp8", "int4"]
WIN = 10


def parse(name: str):
    """``fp32-int4-grpo_seq_mis-s1`` -> (quant, algo, seed)."""
    m = re.match(r"fp32-(?:(int8|fp8|int4)-)?(.+?)(?:-s(\d+))?$", name)
    return (m.group(1) or "none", m.group(2), int(m.group(3) or 0))


def summary(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    rw = series(rows, "reward/mean")
    return {"first": mean(rw[:WIN]), "last": mean(rw[-WIN:]), "best": max(x for x in ma(rw)[WIN - 1:] if math.isfinite(x)),  # full windows only
            "collapse": collapse_step(rw), "k3": mean(series(rows, "mismatch/k3")),
            "tis_out": mean(series(rows, "mismatch/token_rho_outside_fraction")),
            "seq_over": mean(series(rows, "mismatch/seq_rho_over_c_fraction")),
            "masked": mean(series(rows, "correction/masked_fraction")),
            "clip": mean(series(rows, "policy/clip_fraction")),
            "entropy_first": mean(series(rows, "policy/entropy")[:WIN]),
            "entropy_last": mean(series(rows, "policy/entropy")[-WIN:]),
            "lr_last": rows[-1].get("optim/lr"), "surge": rows[-1].get("lr_schedule/surge_step"),
            "wall": sum(r.get("time/step_s") or 0 for r in rows), "rows": rows}


def fmt(v, f="{:.3f}"):
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f.format(v)


def load(stage_dir: Path) -> dict:
    out = {}
    arms = stage_dir / "arms"
    if not arms.is_dir():
        return out
    for run in sorted(arms.iterdir()):
        if (run / "metrics.jsonl").exists():
            out[parse(run.name)] = summary(run)
    return out


def table(runs: dict, title: str, label) -> list[str]:
    head = ("| arm | seeds | acc first 10 | acc last 10 (mean ± sd) | best 10-step | collapsed | mean token k3 | "
            "ρ∉[½,2] tokens | seq ρ>10 | weight 0 (correction) | clip fraction | entropy first→last |")
    lines = [f"### {title}", "", head, "| " + " | ".join("---" for _ in head.split("|")[1:-1]) + " |"]
    groups: dict = {}
    order = sorted(runs, key=lambda k: (QUANTS.index(k[0]), ALGOS.index(k[1]) if k[1] in ALGOS else 99, k[1], k[2]))
    for q, a, s in order:
        groups.setdefault(label(q, a), []).append(runs[(q, a, s)])
    for name, vs in groups.items():
        lines.append(f"| {name} | {len(vs)} | {pm([v['first'] for v in vs])} | {pm([v['last'] for v in vs])} | "
                     f"{pm([v['best'] for v in vs])} | {sum(v['collapse'] is not None for v in vs)}/{len(vs)} | "
                     f"{statistics.mean(v['k3'] for v in vs):.2e} | {statistics.mean(v['tis_out'] for v in vs):.4f} | "
                     f"{statistics.mean(v['seq_over'] for v in vs):.3f} | {statistics.mean(v['masked'] for v in vs):.3f} | "
                     f"{statistics.mean(v['clip'] for v in vs):.3f} | "
                     f"{statistics.mean(v['entropy_first'] for v in vs):.4f}→{statistics.mean(v['entropy_last'] for v in vs):.4f} |")
    return lines + [""]


def every_run(runs: dict, title: str) -> list[str]:
    lines = [f"### {title}", "", "| quantization | algorithm | seed | acc first 10 | acc last 10 | best | collapse step | "
             "mean k3 | final LR | surge step | wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (q, a, s), v in sorted(runs.items(), key=lambda kv: (QUANTS.index(kv[0][0]), ALGOS.index(kv[0][1])
                                                             if kv[0][1] in ALGOS else 99, kv[0][2])):
        surge = None if v["surge"] in (None, -1) else v["surge"]
        lines.append(f"| {q} | {a} | {s} | {fmt(v['first'])} | {fmt(v['last'])} | {fmt(v['best'])} | "
                     f"{fmt(v['collapse'], '{}')} | {v['k3']:.2e} | {fmt(v['lr_last'], '{:.1e}')} | {fmt(surge, '{}')} | "
                     f"{v['wall']:.0f} |")
    return lines + [""]


def curves(groups: dict, path: Path, title: str) -> None:
    """groups: panel title -> {label: [runs]}."""
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (panel, by_label) in zip(axes[0], groups.items()):
        for i, (label, vs) in enumerate(by_label.items()):
            seed_curves(ax, vs, f"C{i}", label)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training accuracy (10-step mean)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    root, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    img = out_md.parent / out_md.stem
    img.mkdir(parents=True, exist_ok=True)
    pilot, grid = load(root / "pilot"), load(root / "grid")
    surge = {**{(q, "grpo + surge_decay (length)", s): v for (q, a, s), v in load(root / "surge_length").items()},
             **{(q, "grpo + surge_decay (k3)", s): v for (q, a, s), v in load(root / "surge_mismatch").items()}}
    intro = Path(__file__).with_name("intro.md")
    lines = [intro.read_text().strip(), ""] if intro.exists() else ["# Low-precision rollout", ""]
    lines += ["## Tables", ""]
    lines += table(pilot, "Pilot (seed 0): every format, GRPO and GRPO + Seq-MIS", lambda q, a: f"{q} / {a}")
    lines += table(grid, "The grid: 3 seeds per arm", lambda q, a: f"{q} / {a}")
    lines += table({**{k: v for k, v in grid.items() if k[0] == "int4" and k[1] == "grpo"}, **surge},
                   "Paper B's LR decay under int4 rollout (GRPO)", lambda q, a: f"{q} / {a}")
    panels = {}
    for q in ("none", "fp8", "int4"):
        by = {}
        for (qq, a, _s), v in sorted(grid.items()):
            if qq == q:
                by.setdefault(a, []).append(v)
        if by:
            panels[f"rollout weights: {q}"] = by
    if panels:
        curves(panels, img / "grid.png", "Paper A's algorithms under quantized rollout (3 seeds; thin: each seed)")
        lines += ["![grid](quantized_rollout/grid.png)", ""]
    lr = {"int4 / grpo (constant LR)": [v for (q, a, s), v in grid.items() if q == "int4" and a == "grpo"]}
    for (_q, a, _s), v in surge.items():
        lr.setdefault(f"int4 / {a}", []).append(v)
    lr["none / grpo (constant LR)"] = [v for (q, a, s), v in grid.items() if q == "none" and a == "grpo"]
    if any(lr.values()):
        curves({"GRPO, int4 rollout weights": {k: v for k, v in lr.items() if v}}, img / "surge.png",
               "Paper B's length-triggered LR decay under int4 rollout")
        lines += ["![surge](quantized_rollout/surge.png)", ""]
    lines += ["## Every run", ""]
    lines += every_run(pilot, "Pilot")
    lines += every_run(grid, "Grid")
    lines += every_run(surge, "Paper B stages")
    out_md.write_text("\n".join(lines) + "\n")
    print(out_md)


if __name__ == "__main__":
    main()
