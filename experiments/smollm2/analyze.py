"""docs/experiments/smollm2.md from runs/smollm2/: the shared tables and curves (experiments/analyze.py)
plus the mismatch ledger's terms and each run's wall time.

    python experiments/smollm2/analyze.py runs/smollm2 docs/experiments/smollm2.md
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from unison.data_io import read_metrics

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from analyze import insert_before_plots, md_table, run_dirs  # noqa: E402  (experiments/analyze.py)


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


def main() -> None:
    runs, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    subprocess.run([sys.executable, str(HERE.parent / "analyze.py"), str(runs), str(out_md), "--title",
                    "SmolLM2-135M: where the mismatch decides the outcome", "--intro", str(HERE / "intro.md")],
                   check=True)
    ledger = ["## The mismatch ledger (per run: each term's k1, mean over the steps that measured it)", "",
              *ledger_rows(runs), ""]
    insert_before_plots(out_md, ledger)
    print(re.sub(r"\s+", " ", f"{out_md}: ledger for {len(ledger) - 4} runs"))


if __name__ == "__main__":
    main()
