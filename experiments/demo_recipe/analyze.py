"""The demo recipe search's report (issue 38): every candidate, and the one the demo uses.

    python experiments/demo_recipe/analyze.py runs/demo_recipe docs

Reads ``runs/demo_recipe/<arm>-lr<LR>[-g<G>]-sft<S>/arms/<run>-s<seed>/metrics.jsonl`` (``run.sh`` makes them) and
writes ``docs/experiments/demo_recipe.md`` and its curves. Per seed, each arm's score is its training accuracy over
the last 10 steps (``reward/mean``). A candidate passes when the int4 GRPO run ends below 80% of the clean run on at
least 5 of its seeds and the quantization-aware run ends at 95% of the clean run or above on every seed.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from unison.data_io import read_metrics  # noqa: E402

WIN, BROKEN, CURED = 10, 0.80, 0.95
REPORT = "experiments/demo_recipe.md"
ARM = re.compile(r"^(clean|int4|qat)-lr([0-9.e-]+)(?:-g(\d+))?-sft(\d+)$")
#: run_stale.sh's arms: K = 0 clean, K = 4 naive (broken), K = 4 + a cure (its variant named after "cure-")
STALE_ARM = re.compile(r"^stale-(clean|broken|cure)-(k[\w.-]*?)-lr([0-9.e-]+)-sft(\d+)$")
STALE = "stale"
#: the stale cures run_stale.sh runs: variant -> what the regime column says
STALE_CURES = {
    "k4budget": "mismatch_budget LR (defaults)",
    "k4budget-down0.5": "mismatch_budget LR, down 0.5",
    "k4budget-warmup10": "mismatch_budget LR + 10 warm-up steps",
    "k4warmup10": "10 warm-up steps alone (control)",
    "k4lr3e-5": "constant LR 3e-5 (control)",
    "k0lr2e-5": "fresh samples (K = 0) at a constant LR 2e-5, the clean run at the cure's LR (its cure column)",
    "k4budget-start0.1": "mismatch_budget LR, start 0.1",
    "k4budget-start0.1-target3e-3": "mismatch_budget LR, start 0.1, target 3e-3",
    "k4budget-start0.1-target3e-3-tis": "mismatch_budget LR, start 0.1, target 3e-3 + Token-TIS (grpo_token_tis)",
    "k4budget-start0.1-target3e-3-icepop": "mismatch_budget LR, start 0.1, target 3e-3 + IcePop (grpo_icepop)",
    "k4budget-start0.1-target3e-3-tis-k3metric": "the demo's: as Token-TIS's, the budget watching mismatch/k3 "
                                                 "(no staleness pass)",
    # the controls (run_controls.sh, issue 52): a constant LR with and without the correction, the budget without it,
    # Paper B's own schedule
    "k4tis-const1e-5": "Token-TIS at a constant LR 1e-5 (control)",
    "k4tis-const2e-5": "Token-TIS at a constant LR 2e-5 (control)",
    "k4tis-const3e-5": "Token-TIS at a constant LR 3e-5 (control)",
    "k4tis-const5e-5": "Token-TIS at a constant LR 5e-5 (control)",
    "k4tis-const1e-4": "Token-TIS at the recipe's LR 1e-4 (control)",
    "k4lr1e-5": "GRPO at a constant LR 1e-5 (control)",
    "k4lr2e-5": "GRPO at a constant LR 2e-5 (control)",
    "k4budget-start0.1-target3e-3-k3metric": "the demo's budget without Token-TIS (control)",
    "k4surge": "Paper B's surge_decay on response length (control)",
    "k4surge-tis": "Paper B's surge_decay on response length + Token-TIS (control)",
    "k4budget-tis-base5e-5": "the demo's cure from a base LR of 5e-5 (the budget starts at 5e-6)",
    "k4budget-tis-base2e-4": "the demo's cure from a base LR of 2e-4 (the budget starts at 2e-5)",
    "k4budget-tis-base5e-4": "the demo's cure from a base LR of 5e-4 (the budget starts at 5e-5)",
}


def tail(rows, key="reward/mean", n=WIN):
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))][-n:]
    return sum(xs) / len(xs) if xs else float("nan")


def runs(arm_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for d in sorted((arm_dir / "arms").glob("*-s*")):
        m = d / "metrics.jsonl"
        if m.exists() and (d / "summary.json").exists():  # finished runs only (a search stopped early leaves one half-run)
            out[int(d.name.rsplit("-s", 1)[1])] = read_metrics(m)
    return out


def candidates(root: Path) -> dict[tuple, dict]:
    """(lr, group, sft) -> {"clean"|"int4"|"qat": {seed: rows}}; the clean run has no group: shared by groups."""
    arms = {}
    for d in sorted(root.iterdir()):
        m = ARM.match(d.name)
        if m:
            arms[(m[1], m[2], m[3], m[4])] = runs(d)
    out = {}
    for (kind, lr, group, sft), seeds in arms.items():
        if kind == "clean":
            continue
        key = (lr, group, sft)
        out.setdefault(key, {"clean": arms.get(("clean", lr, None, sft), {})})[kind] = seeds
    stale = {}  # the stale regime: its kinds in the int4 regime's places, clean and broken shared by every cure
    for d in sorted(root.iterdir()):
        m = STALE_ARM.match(d.name)
        if m:
            stale[(m[1], m[2] if m[1] == "cure" else None, m[3], m[4])] = runs(d)
    for (kind, variant, lr, sft), seeds in stale.items():
        if kind == "cure":
            out[(lr, f"{STALE}:{variant}", sft)] = {"clean": stale.get(("clean", None, lr, sft), {}),
                                                    "int4": stale.get(("broken", None, lr, sft), {}), "qat": seeds}
    return out


#: the cure unison demo runs (unison/demo.py, REGIMES["stale"]): the page's pick while it passes
DEMO_CURE = "k4budget-start0.1-target3e-3-tis-k3metric"
#: rows that are references, not cures (no K = 4 run in them): reported, never picked
REFERENCES = {f"{STALE}:k0lr2e-5"}


def regime(group) -> str:
    if group in REFERENCES:
        return f"reference: {STALE_CURES[group.split(':', 1)[1]]}"
    if str(group).startswith(STALE):
        variant = group.split(":", 1)[1]
        return f"K = 4 stale, GRPO; cure: {STALE_CURES.get(variant, variant)}"
    return f"int4 g{group}, GRPO; cure: QAT"


#: the demo's part 2 runs this many steps of the stale regime (unison/demo.py): the criterion at that length too
DEMO_STEPS = 25


def judge(c: dict, steps: int | None = None) -> dict:
    """Per seed that has all three arms (a candidate stopped early: the seeds with a clean and an int4 run);
    ``steps``: as if every run had stopped there (the first steps of a longer run are the shorter run's)."""
    c = {"qat": {}, **c}
    if steps is not None:
        c = {kind: {s: rows[:steps] for s, rows in seeds.items()} for kind, seeds in c.items()}
    seeds = sorted(set(c.get("clean", {})) & set(c.get("int4", {})) & (set(c["qat"]) or set(c.get("int4", {}))))
    screened = bool(c["qat"]) and len(c["qat"]) < 6  # a cure screened on a few seeds first
    per = []
    for s in seeds:
        clean, broken = tail(c["clean"][s]), tail(c["int4"][s])
        cured = tail(c["qat"][s]) if s in c["qat"] else float("nan")
        start = tail(c["int4"][s][:WIN])
        per.append({"seed": s, "clean": clean, "int4": broken, "qat": cured, "int4_start": start,
                    "collapsed": broken < BROKEN * clean, "cured": cured >= CURED * clean,
                    "steps": len(c["int4"][s])})
    n = len(per)
    if not c["qat"]:
        return {"seeds": per, "n": n, "collapsed": sum(p["collapsed"] for p in per), "cured": 0, "passes": False,
                "stopped": True}
    return {"seeds": per, "n": n, "collapsed": sum(p["collapsed"] for p in per),
            "cured": sum(p["cured"] for p in per), "screened": screened,
            "passes": n >= 6 and sum(p["collapsed"] for p in per) >= n - 1 and all(p["cured"] for p in per)}


def fmt_mean(xs):
    xs = [x for x in xs if x == x]
    if not xs:
        return "—"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main(root: Path, docs: Path) -> Path:
    cands = candidates(root)
    judged = {k: judge(v) for k, v in cands.items()}
    short = {k: judge(v, DEMO_STEPS) for k, v in cands.items()}
    intro = Path(__file__).with_name("intro.md")
    lines = ["# The demo's recipe: a collapse that cannot miss", "",
             *([intro.read_text().rstrip(), ""] if intro.exists() else []),
             "Generated by `experiments/demo_recipe/analyze.py` from `bash experiments/demo_recipe/run.sh` (int4) and "
             "`bash experiments/demo_recipe/run_stale.sh` (samples 4 versions old; every run one thread, two side by "
             "side).", "",
             "Each candidate is the demo's part 2 (scratchpad sums, 7 operands of 2 digits, the working written out, "
             "16 prompts × 8 samples, 4 mini-batches per step, tiny model, fp32) run for 30 steps as three arms "
             "sharing one warm start and perfectible set: the clean run, the broken run (int4 rollout weights with "
             "GRPO, or samples 4 policy versions old, `rollout.max_staleness: 4`, with GRPO) and the cure. A seed's "
             "score is its training accuracy over the last 10 steps. The criterion: the broken run ends "
             f"below {BROKEN:.0%} of the clean run on ≥ 5/6 seeds and the cure at ≥ {CURED:.0%} of it on 6/6. A cure "
             "is screened on seeds 2 and 5 (where the default budget did worst) before it runs on all 6.", "",
             "Seeds stand in for CPUs: another CPU changes the sampled path the way another seed does (other kernels, "
             "other rounding, other samples), so a recipe that holds on 6 seeds on one CPU is the one that can hold "
             "on a CPU it never ran on. Every row below ran on one CPU: an Intel Xeon (2 cores, family 6 model 167, "
             "AVX-512 with avx512_bf16, avx512_fp16 and AMX), torch 2.13.0; the search's first rows ran on an AMD "
             "EPYC (Zen 4-class) and were rerun here (the clean, the K = 4 and the default-budget arms: 0.918, 0.080 "
             "and 0.479 here against 0.917, 0.083 and 0.479 there).", "",
             "| lr | regime | SFT steps | seeds | clean | broken | cure | collapsed (< 80% clean) "
             f"| cured (≥ 95% clean) | passes | at {DEMO_STEPS} steps: collapsed / cured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (lr, group, sft), j in sorted(judged.items(), key=lambda kv: (str(kv[0][1]).startswith(STALE),
                                                                      float(kv[0][0]), str(kv[0][1]), int(kv[0][2]))):
        p = j["seeds"]
        cured = "—" if j.get("stopped") else f"{j['cured']}/{j['n']}"
        verdict = "reference (K = 0)" if group in REFERENCES else "stopped" if j.get("stopped") else \
            "yes" if j["passes"] else \
            ("screened: failed" if not all(x["cured"] for x in p) else "screened") if j.get("screened") else "no"
        lines.append(f"| {lr} | {regime(group)} | {sft} | {j['n']} | {fmt_mean([x['clean'] for x in p])} | "
                     f"{fmt_mean([x['int4'] for x in p])} | {fmt_mean([x['qat'] for x in p])} | "
                     f"{j['collapsed']}/{j['n']} | {cured} | {verdict} | "
                     + ("—" if j.get("stopped") else f"{short[(lr, group, sft)]['collapsed']}/{j['n']} / "
                        f"{short[(lr, group, sft)]['cured']}/{j['n']}") + " |")
    lines += ["", "Every seed of every candidate (last-10 training accuracy; the cure's share of the clean run):", "",
              "| candidate | seed | clean | broken | cure | cure / clean |", "| --- | --- | --- | --- | --- | --- |"]
    for (lr, group, sft), j in sorted(judged.items(), key=lambda kv: (str(kv[0][1]), float(kv[0][0]), int(kv[0][2]))):
        for x in j["seeds"]:
            if x["qat"] != x["qat"]:  # a cure still running, or stopped before this seed
                continue
            share = f"{x['qat'] / x['clean']:.1%}"
            lines.append(f"| lr {lr}, {regime(group)}, SFT {sft} | {x['seed']} | {x['clean']:.3f} | {x['int4']:.3f} | "
                         f"{x['qat']:.3f} | {share} |")
    passing = [k for k, j in judged.items() if j["passes"] and k[1] not in REFERENCES]
    complete = {k: j for k, j in judged.items() if not j.get("stopped") and k[1] not in REFERENCES}
    # the pick: a passing candidate with the widest margin (smallest int4/clean, then largest qat/clean)
    def margin(k):
        p = judged[k]["seeds"]
        return (max(x["int4"] / x["clean"] for x in p), -min(x["qat"] / x["clean"] for x in p))
    widest = min(passing, key=margin) if passing else None
    demo = next((k for k in passing if k[1] == f"{STALE}:{DEMO_CURE}"), None)
    pick = demo or widest
    lines += [""]
    if pick is None:
        lines += ["**No candidate passes.** The closest, by its worst seed:", ""]
        pick = min(complete, key=lambda k: (-(complete[k]["cured"] + complete[k]["collapsed"]), margin(k))) if complete else None
    elif demo:
        lines += [f"**The demo's cure: lr {pick[0]}, {regime(pick[1])}, {pick[2]} SFT steps** (it passes; of the "
                  f"passing candidates the widest margin on the worst seed is {regime(widest[1])}'s).", ""]
    else:
        lines += [f"**The pick: lr {pick[0]}, {regime(pick[1])}, {pick[2]} SFT steps** (of the passing candidates, "
                  "the one whose worst seed has the widest margin).", ""]
    if pick is not None:
        j = judged[pick]
        lines += ["| seed | clean | broken (first 10 → last 10) | broken / clean | cure | cure / clean |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for x in j["seeds"]:
            lines.append(f"| {x['seed']} | {x['clean']:.3f} | {x['int4_start']:.3f} → {x['int4']:.3f} | "
                         f"{x['int4'] / x['clean']:.0%} | {x['qat']:.3f} | {x['qat'] / x['clean']:.1%} |")
        plots = docs / "experiments" / "demo_recipe"
        plots.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4))
        c = cands[pick]
        for kind, color in (("clean", "tab:green"), ("int4", "tab:red"), ("qat", "tab:blue")):
            for i, (_s, rows) in enumerate(sorted(c[kind].items())):
                ys = [r["reward/mean"] for r in rows if "reward/mean" in r]
                ax.plot(range(1, len(ys) + 1), ys, color=color, alpha=0.5, lw=1,
                        label={"clean": "clean", "int4": "broken", "qat": "cure"}[kind] if i == 0 else None)
        ax.set_xlabel("step"), ax.set_ylabel("training accuracy"), ax.legend(), ax.grid(alpha=0.3)
        ax.set_title(f"lr {pick[0]}, {regime(pick[1])}, SFT {pick[2]}: every seed", fontsize=9)
        fig.tight_layout()
        fig.savefig(plots / "curves.png", dpi=110)
        plt.close(fig)
        lines += ["", "![every seed of the pick](demo_recipe/curves.png)", ""]
    out = docs / REPORT
    out.write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) > 2 else "docs")))
