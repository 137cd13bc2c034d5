"""docs/experiments/smollm2.md from runs/smollm2/: the shared tables and curves (experiments/analyze.py)
plus the mismatch ledger's terms and each run's wall time.

    python experiments/smollm2/analyze.py runs/smollm2 docs/experiments/smollm2.md
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from analyze import insert_before_plots, ledger_rows  # noqa: E402  (experiments/analyze.py)


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
