"""Tables and curves of experiments/cures (issue 27), written under docs/experiments/.

    python experiments/cures/analyze.py runs/cures docs

Writes ``experiments/cures.md`` under ``docs`` (+ its PNGs) and the "Cures" sections of
``experiments/quantized_rollout.md`` and ``experiments/staleness.md`` (between ``<!-- cures:begin -->``
and ``<!-- cures:end -->``). Every arm is a directory
``runs/cures/<arm>/arms/<run>-s<seed>``; each lever is compared with its regime's collapsing baseline and
with the clean run **paired by seed** (the same seeds ran in every arm: per-seed differences, mean and 95%
t-interval), and the goal is checked per seed: a lever reaches ≥ 95% of the clean run's last-10 training
accuracy on 3/3 seeds. ``experiments/cures/intro.md`` (what was found, written from these numbers) goes first.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from analyze import collapse_step, ma, mean, pm, seed_curves, series  # noqa: E402

from unison.data_io import read_metrics  # noqa: E402
from unison.ledger import TERMS  # noqa: E402
from unison.report import paired_interval  # noqa: E402

WIN = 10
GOAL = 0.95
#: regime -> (clean arm, collapsing baseline, levers, the mismatch metric shown)
REPORT, QUANT_REPORT, STALE_REPORT = "experiments/cures.md", "experiments/quantized_rollout.md", "experiments/staleness.md"
REGIMES = {
    "int4 rollout": ("q-none-grpo", "q-int4-grpo",
                     ["q-int4-qat", "q-int4-icepop", "q-int4-ipo", "q-int4-ipo_wide", "q-int4-m2po", "q-int4-m2po_mask",
                      "q-int4-budget"],
                     "mismatch/k3"),
    "fp8 rollout": ("q-none-grpo", "q-fp8-grpo", ["q-fp8-qat"], "mismatch/k3"),
    "K = 4 staleness": ("k0-naive", "k4-naive",
                        ["k4-decoupled", "k4-dppo", "k4-icepop", "k4-ipo", "k4-ipo_wide", "k4-m2po", "k4-m2po_mask",
                         "k4-budget"],
                        "mismatch/staleness_k3"),
    "top-p 0.9": ("q-none-grpo", "p-topp-noreplay", ["p-topp-replay"], "mismatch/k3"),
}
LABELS = {
    "q-none-grpo": "no quantization, GRPO (clean)", "q-int4-grpo": "int4, GRPO", "q-int4-qat": "int4, GRPO + quantization_aware",
    "q-int4-icepop": "int4, grpo_icepop", "q-int4-ipo": "int4, ipo (ε 0.1, τ 1e-3)", "q-int4-ipo_wide": "int4, ipo (ε 0.3, τ 0)",
    "q-int4-m2po": "int4, grpo_m2po (AReaL's decoupled M2PO)", "q-int4-m2po_mask": "int4, grpo_m2po_mask (mask only)",
    "q-int4-budget": "int4, GRPO + mismatch_budget", "q-fp8-grpo": "fp8, GRPO",
    "q-fp8-qat": "fp8, GRPO + quantization_aware", "k0-naive": "K = 0, naive (clean)", "k4-naive": "K = 4, naive",
    "k4-decoupled": "K = 4, decoupled (grpo_token_tis)", "k4-dppo": "K = 4, dppo_tv + bypass",
    "k4-icepop": "K = 4, grpo_icepop", "k4-ipo": "K = 4, ipo (ε 0.1, τ 1e-3)", "k4-ipo_wide": "K = 4, ipo (ε 0.3, τ 0)",
    "k4-m2po": "K = 4, grpo_m2po (AReaL's decoupled M2PO)", "k4-m2po_mask": "K = 4, grpo_m2po_mask (mask only)",
    "k4-budget": "K = 4, naive + mismatch_budget",
    "p-topp-noreplay": "top-p 0.9, GRPO, no replay", "p-topp-replay": "top-p 0.9, GRPO + sampling-mask replay",
}


def load(root: Path) -> dict[str, dict[int, dict]]:
    """arm -> seed -> summary, for every finished run (60 steps) under ``root``."""
    out: dict[str, dict[int, dict]] = {}
    for arm_dir in sorted(p for p in root.iterdir() if (p / "arms").is_dir()):
        for run in sorted((arm_dir / "arms").iterdir()):
            m = re.match(r".*-s(\d+)$", run.name)
            if not m or not (run / "metrics.jsonl").exists():
                continue
            rows = read_metrics(run / "metrics.jsonl")
            out.setdefault(arm_dir.name, {})[int(m.group(1))] = summarize(rows)
    return out


def summarize(rows: list[dict]) -> dict:
    rw = series(rows, "reward/mean")
    led = [r for r in rows if "ledger/total_k3" in r]
    shares = {}
    for t in TERMS:
        vals = [r.get(f"ledger/{t}_k3") for r in led]
        if any(v is not None for v in vals):
            shares[t] = mean([v or 0.0 for v in vals])
    return {"steps": len(rows), "first": mean(rw[:WIN]), "last": mean(rw[-WIN:]),
            "best": max((x for x in ma(rw)[WIN - 1:] if math.isfinite(x)), default=float("nan")),
            "collapse": collapse_step(rw), "k3": mean(series(rows, "mismatch/k3")),
            "staleness_k3": mean(series(rows, "mismatch/staleness_k3")),
            "masked": mean(series(rows, "correction/masked_fraction")),
            "clip": mean(series(rows, "policy/clip_fraction")),
            "ipo_masked": mean(series(rows, "policy/ipo_masked_fraction")),
            "lr_last": rows[-1].get("optim/lr") if rows else None,
            "lr_min": min((r["optim/lr"] for r in rows if isinstance(r.get("optim/lr"), float)), default=None),
            "ledger": shares, "ledger_total": mean([r["ledger/total_k3"] for r in led]) if led else float("nan"),
            "ledger_time": sum(r.get("time/ledger_s", 0.0) for r in led), "ledger_steps": len(led),
            "wall": sum(r.get("time/step_s") or 0 for r in rows), "rows": rows}


def fmt(v, f="{:.3f}"):
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f.format(v)


def paired(arms, arm, ref, key="last"):
    shared = sorted(set(arms.get(arm, {})) & set(arms.get(ref, {})))
    diffs = [arms[arm][s][key] - arms[ref][s][key] for s in shared]
    if not diffs:
        return "–"
    m, lo, hi = paired_interval(diffs)
    ci = f" [{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) else ""
    return f"{m:+.3f}{ci}"


def goal(arms, arm, clean) -> tuple[int, int]:
    """Seeds on which ``arm``'s last-10 accuracy reaches GOAL × the clean run's of the same seed."""
    shared = sorted(set(arms.get(arm, {})) & set(arms.get(clean, {})))
    return sum(arms[arm][s]["last"] >= GOAL * arms[clean][s]["last"] for s in shared), len(shared)


def regime_table(arms, name) -> list[str]:
    clean, base, levers, metric = REGIMES[name]
    key = "staleness_k3" if metric.endswith("staleness_k3") else "k3"
    head = ["arm", "seeds", "acc first 10", "acc last 10 (mean ± sd)", "best 10-step", "collapsed",
            f"mean {'staleness ' if key != 'k3' else ''}k3", "masked / clipped", "final LR",
            f"Δ last 10 vs {base} (paired, 95% CI)", f"Δ vs clean {clean}", f"≥ {GOAL:.0%} of clean (seeds)"]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for arm in [clean, base, *levers]:
        runs = arms.get(arm)
        if not runs:
            out.append(f"| {LABELS.get(arm, arm)} | 0 | not run | | | | | | | | | |")
            continue
        s = list(runs.values())
        masked = mean([max(x["masked"] if math.isfinite(x["masked"]) else 0.0,
                           x["ipo_masked"] if math.isfinite(x["ipo_masked"]) else 0.0) for x in s])
        g, n = goal(arms, arm, clean)
        out.append("| " + " | ".join([
            LABELS.get(arm, arm), str(len(s)), pm([x["first"] for x in s]), pm([x["last"] for x in s]),
            pm([x["best"] for x in s]), f"{sum(x['collapse'] is not None for x in s)}/{len(s)}",
            fmt(mean([x[key] for x in s]), "{:.2e}"), f"{masked:.3f} / {mean([x['clip'] for x in s]):.3f}",
            fmt(mean([x["lr_last"] for x in s if x["lr_last"] is not None]), "{:.1e}"),
            "(baseline)" if arm == base else paired(arms, arm, base),
            "(clean)" if arm == clean else paired(arms, arm, clean),
            "–" if arm == clean else f"{g}/{n}"]) + " |")
    return out


def ranking(arms, name) -> list[str]:
    clean, base, levers, _ = REGIMES[name]
    done = [a for a in [base, *levers] if arms.get(a)]
    done.sort(key=lambda a: -mean([x["last"] for x in arms[a].values()]))
    return [f"{i}. {LABELS.get(a, a)}: {pm([x['last'] for x in arms[a].values()])}"
            f"{' — reaches the goal on every seed' if goal(arms, a, clean)[0] == goal(arms, a, clean)[1] == 3 else ''}"
            for i, a in enumerate(done, 1)]


#: arms whose ledger was measured again, seed 0, after the fix of commit "ledger: the learner's passes run before
#: the update" (before it, a synchronous quantized run's learner passes ran after the step's update, so the
#: engine and quantization terms measured the update too; training is unaffected: the ledger changes nothing
#: else, tested bit for bit) — ``runs/cures-ledger/<name>``, written by experiments/cures/ledger_rerun.sh
REMEASURED = {"q-int4-grpo": "int4-grpo", "q-fp8-grpo": "fp8-grpo"}


def ledger_lines(arms, root: Path) -> list[str]:
    out = ["| arm | ledger steps | mean total k3 | " + " | ".join(TERMS) + " | ledger time / run time |",
           "| --- | --- | --- | " + " | ".join("---" for _ in TERMS) + " | --- |"]
    again = root.parent / "cures-ledger"
    for arm in ("q-none-grpo", "q-int4-grpo", "q-fp8-grpo", "k4-naive", "p-topp-noreplay", "p-topp-replay", "q-int4-qat"):
        runs = arms.get(arm)
        label = LABELS.get(arm, arm)
        if arm in REMEASURED:
            redo = load(again).get(REMEASURED[arm]) if again.is_dir() else None
            if not redo:
                continue  # measured before the fix only: not shown
            runs, label = redo, f"{label} (seed 0, measured again)"
        if not runs:
            continue
        s = list(runs.values())
        cells = []
        for t in TERMS:
            vals = [x["ledger"].get(t) for x in s if t in x["ledger"]]
            tot = mean([sum(max(v, 0.0) for v in x["ledger"].values()) for x in s])
            cells.append("–" if not vals else f"{mean(vals):.2e} ({100 * mean(vals) / tot if tot > 0 else 0:.0f}%)")
        share = sum(x["ledger_time"] for x in s) / max(sum(x["wall"] for x in s), 1e-9)
        out.append(f"| {label} | {s[0]['ledger_steps']} | {mean([x['ledger_total'] for x in s]):.2e} | "
                   + " | ".join(cells) + f" | {share:.1%} |")
    return out


def deploy_lines(root: Path) -> list[str]:
    path = root / "deploy_gap.json"
    if not path.exists():
        return ["(deploy gap not measured yet: `python experiments/cures/deploy_gap.py runs/cures`)"]
    rows = json.loads(path.read_text())
    out = ["| checkpoint | fp32 sampling (π) | int4 sampling (μ) |", "| --- | --- | --- |"]
    order = ["SFT start", "q-none-grpo", "q-int4-grpo", *REGIMES["int4 rollout"][2]]
    for arm in order:
        cells = []
        for q in ("none", "int4"):
            xs = [r["acc"] for r in rows if r["arm"] == arm and r["engine"] == q]
            cells.append(pm(xs))
        if cells != ["–", "–"]:
            out.append(f"| {LABELS.get(arm, arm) if arm != 'SFT start' else arm}{'' if arm == 'SFT start' else ', step 60'} "
                       f"| {cells[0]} | {cells[1]} |")
    return out


def plots(arms, img: Path) -> list[Path]:
    img.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(REGIMES), figsize=(6 * len(REGIMES), 4.6), squeeze=False)
    for ax, (name, (clean, base, levers, _)) in zip(axes[0], REGIMES.items()):
        for ci, arm in enumerate([clean, base, *levers]):
            if arms.get(arm):
                seed_curves(ax, list(arms[arm].values()), f"C{ci % 10}", LABELS.get(arm, arm))
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("training accuracy (10-step mean)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = img / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def section(arms, names) -> list[str]:
    lines = []
    for name in names:
        lines += [f"### {name}", "", *regime_table(arms, name), "", "Ranked by last-10 accuracy (mean ± sd):", "",
                  *ranking(arms, name), ""]
    return lines


def m2po_section(root: Path, docs: Path) -> Path:
    """``--m2po RUNS DOCS``: the M2PO re-run (issue 42: ``grpo_m2po`` became AReaL's decoupled M2PO) as its own block
    of experiments/cures.md, between ``<!-- m2po:begin -->`` and ``<!-- m2po:end -->``, each regime's clean run and
    collapsing baseline re-run beside it (paired by seed on this CPU)."""
    arms = load(root)
    saved = dict(REGIMES)
    REGIMES.clear()
    REGIMES.update({"int4 rollout": (saved["int4 rollout"][0], saved["int4 rollout"][1], ["q-int4-m2po"], "mismatch/k3"),
                    "K = 4 staleness": (saved["K = 4 staleness"][0], saved["K = 4 staleness"][1], ["k4-m2po"],
                                        "mismatch/staleness_k3")})
    try:
        lines = section(arms, list(REGIMES))
    finally:
        REGIMES.clear()
        REGIMES.update(saved)
    wall = sum(x["wall"] for runs in arms.values() for x in runs.values())
    block = "\n".join(["<!-- m2po:begin -->", "## M2PO as AReaL runs it (re-run, issue 42)", "",
                       "`grpo_m2po` is now AReaL's M2PO: the decoupled loss's behaviour weight π_old/μ (tokens above 5 "
                       "masked) on the tokens M2PO's batch mask keeps; the rows labelled `grpo_m2po_mask` above are the "
                       "variant that ran as `grpo_m2po` before (the 0/1 mask alone, no behaviour weight: without it "
                       "AReaL's M2 term is identically 0). Same recipe, 3 seeds, each regime's clean and collapsing runs "
                       "re-run beside it on this CPU and paired by seed (`ARMS=\"q-none-grpo q-int4-grpo q-int4-m2po "
                       "k0-naive k4-naive k4-m2po\" OUT=runs/cures-m2po bash experiments/cures/run.sh && python "
                       f"experiments/cures/analyze.py --m2po runs/cures-m2po docs`; step time {wall / 3600:.1f} h):", "",
                       *lines, "<!-- m2po:end -->"])
    report = docs / REPORT
    text = report.read_text()
    if "<!-- m2po:begin -->" in text:
        text = re.sub(r"<!-- m2po:begin -->.*<!-- m2po:end -->", lambda _: block, text, flags=re.S)
    else:
        anchor = "## Is the learner worse"
        text = text.replace(anchor, block + "\n\n" + anchor, 1) if anchor in text else text.rstrip() + "\n\n" + block
    report.write_text(text + ("" if text.endswith("\n") else "\n"))
    return report


def main() -> None:
    if sys.argv[1] == "--m2po":
        print(m2po_section(Path(sys.argv[2]), Path(sys.argv[3])))
        return
    root, docs = Path(sys.argv[1]), Path(sys.argv[2])
    arms = load(root)
    report = docs / REPORT
    img = report.with_suffix("")
    pics = plots(arms, img)
    intro_path = Path(__file__).resolve().parent / "intro.md"
    intro = intro_path.read_text().strip() if intro_path.exists() else ""
    wall = {a: sum(x["wall"] for x in runs.values()) for a, runs in arms.items()}
    lines = ["# The cures the field ships, on the two runs that collapse (issue 27)", "", intro, "",
             "## Every regime", "", *section(arms, list(REGIMES)),
             "## Is the learner worse, or only its int4 copy? (deploy gap)", "",
             "Each seed's final fp32 masters sampled by two engines over the same weights, 64 perfectible prompts × 8 "
             "(`python experiments/cures/deploy_gap.py runs/cures`):", "", *deploy_lines(root), "",
             "## Where the mismatch came from (the ledger, every 10th step; K = 4: every 5th)", "",
             "Mean k3 of each term over the logged steps and seeds (share of Σk3):", "", *ledger_lines(arms, root), "",
             *[f"![{p.stem}]({img.name}/{p.name})" for p in pics], "",
             "## Run time", "",
             f"Step time summed over every arm and seed: {sum(wall.values()) / 3600:.1f} h "
             f"({len(arms)} arms); per arm (3 seeds): " + ", ".join(f"{a} {w / 60:.0f} min" for a, w in sorted(wall.items())),
             ""]
    report.write_text("\n".join(lines) + "\n")
    link = f"[{report.name}]({report.name})"
    for doc, names in ((QUANT_REPORT, ["int4 rollout", "fp8 rollout", "top-p 0.9"]), (STALE_REPORT, ["K = 4 staleness"])):
        path = docs / doc
        text = path.read_text()
        block = "\n".join(["<!-- cures:begin -->", "## Cures (issue 27)", "",
                           "The levers the field ships, at the same recipe, 3 seeds, paired by seed against the collapsing "
                           "run and the clean one (`bash experiments/cures/run.sh`; the whole report, the deploy gap and "
                           f"the ledger: {link}).", "", *section(arms, names), "<!-- cures:end -->"])
        if "<!-- cures:begin -->" in text:
            text = re.sub(r"<!-- cures:begin -->.*<!-- cures:end -->", lambda _: block, text, flags=re.S)
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        path.write_text(text)
    print(report)


if __name__ == "__main__":
    main()
