"""docs/experiments/smollm2-stale.md from runs/smollm2_stale/ (run_stale.sh, run_precision.sh): the shared tables and
curves (experiments/analyze.py, intro from intro_stale.md), each arm against the clean run and against the broken
one seed by seed, and the mismatch ledger's terms.

    python experiments/smollm2/analyze_stale.py runs/smollm2_stale docs/experiments/smollm2-stale.md
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from analyze import insert_before_plots, ledger_rows, md_table, run_dirs, summarize  # noqa: E402  (experiments/analyze.py)


def by_arm(runs: Path) -> dict[str, dict[int, dict]]:
    """{arm: {seed: summary}} of every run directory named ARM-sSEED."""
    out: dict[str, dict[int, dict]] = {}
    for run in run_dirs(runs):
        m = re.match(r"(.*)-s(\d+)$", run.name)
        if m and (run / "summary.json").exists():  # finished runs only
            out.setdefault(m.group(1), {})[int(m.group(2))] = summarize(run)
    return out


def paired_rows(arms: dict[str, dict[int, dict]], clean: str, broken: str) -> list[str]:
    """Per arm: last-10 accuracy seed by seed, and its difference to the clean and the broken run of the same seed."""
    head = ["arm", "seeds", "acc last 10 (per seed)", "best 10 (per seed)", "− clean (per seed)", "− broken (per seed)",
            "mean k3"]
    rows = []
    for arm, seeds in sorted(arms.items()):
        ss = sorted(seeds)

        def per(key, ref=None, ss=ss, seeds=seeds):
            vals = []
            for s in ss:
                if ref is None:
                    vals.append(f"{seeds[s][key]:.3f}")
                elif ref in arms and s in arms[ref]:
                    vals.append(f"{seeds[s][key] - arms[ref][s][key]:+.3f}")
                else:
                    vals.append("–")
            return ", ".join(vals)

        k3 = sum(seeds[s]["k3_mean"] for s in ss) / len(ss)
        rows.append([arm, ",".join(map(str, ss)), per("acc_final"), per("acc_max10"),
                     per("acc_final", clean) if arm != clean else "", per("acc_final", broken) if arm != broken else "",
                     f"{k3:.2e}"])
    return md_table(head, rows)


def main() -> None:
    runs, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    clean = sys.argv[3] if len(sys.argv) > 3 else "clean-lr1e-5"
    broken = sys.argv[4] if len(sys.argv) > 4 else "k4-lr1e-5"
    subprocess.run([sys.executable, str(HERE.parent / "analyze.py"), str(runs), str(out_md), "--title",
                    "SmolLM2-135M: samples K versions old, and their cures", "--intro",
                    str(HERE / "intro_stale.md"), "--extra-cols", "lr"], check=True)
    arms = by_arm(runs)
    lines = [f"## Against the clean run (`{clean}`) and the broken one (`{broken}`), seed by seed", "",
             "Last-10-step training accuracy of each finished run, and its difference to the run of the same seed "
             "(a difference on one seed is one sample, not a ranking).", "", *paired_rows(arms, clean, broken), "",
             "## The mismatch ledger (per run: each term's k1, mean over the steps that measured it)", "",
             *ledger_rows(runs), ""]
    insert_before_plots(out_md, lines)
    print(f"{out_md}: {sum(len(s) for s in arms.values())} finished runs in {len(arms)} arms")


if __name__ == "__main__":
    main()
