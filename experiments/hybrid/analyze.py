"""docs/experiments/hybrid.md from runs/hybrid/ (experiments/hybrid/run.sh): every arm seed by seed — training
accuracy (first 10 steps, last 10, best 10-step mean), steps to 95%, the mismatch (token k3) and the ledger's decode
and engine terms (mean over the steps that measured them).

    python experiments/hybrid/analyze.py runs/hybrid docs/experiments/hybrid.md [runs/hybrid_exact]

The optional third directory is experiments/hybrid/run_exact.sh's (Nemotron-H: fp32, bf16, bf16 in exact mode),
reported as its own table after intro_exact.md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from analyze import md_table, mean, series, summarize  # noqa: E402  (experiments/analyze.py)

from unison.data_io import read_metrics  # noqa: E402

#: (sanity output, arm name prefix) -> the label in the report
ARMS = {("state-fp32", "fp32"): "fp32", ("state-fp32", "bf16"): "bf16, engine's state fp32",
        ("state-model", "bf16"): "bf16, engine's state bf16 (rollout.state_dtype=model)",
        ("exact", "bf16-exact"): "bf16, exact mode"}
#: run_exact.sh's arms (one sanity output)
EXACT_ARMS = {("arms", "fp32"): "fp32", ("arms", "bf16"): "bf16", ("arms", "bf16-exact"): "bf16, exact mode"}


def arms(root: Path, table: dict = ARMS) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for (sub, prec), label in table.items():
        for run in sorted((root / sub / "arms").glob(f"{prec}-grpo-s*")):
            if not (run / "metrics.jsonl").exists():
                continue
            seed = int(re.search(r"-s(\d+)$", run.name).group(1))
            rows = read_metrics(run / "metrics.jsonl")
            s = summarize(run)
            s["decode"] = mean(series(rows, "ledger/decode_k3"))
            s["engine"] = mean(series(rows, "ledger/engine_k3"))
            out.setdefault(label, {})[seed] = s
    return out


def fmt(v, f):
    return "–" if v is None or v != v else format(v, f)  # none measured (an exact arm has no ledger): –


def table(found: dict) -> str:
    rows = [[label, str(seed), fmt(s["acc_first"], ".3f"), fmt(s["acc_final"], ".3f"), fmt(s["acc_max10"], ".3f"),
             fmt(s["steps_to_95"], "d"), fmt(s["k3_mean"], ".2e"), fmt(s["decode"], ".1e"), fmt(s["engine"], ".1e")]
            for label, seeds in found.items() for seed, s in sorted(seeds.items())]
    head = ["arm", "seed", "acc first 10", "acc last 10", "best 10", "steps to 95%", "token k3 (mean)",
            "ledger: decode", "ledger: engine"]
    return "\n".join(md_table(head, rows)) + "\n"


def main() -> None:
    root, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    found = arms(root)
    text = (HERE / "intro.md").read_text().rstrip() + "\n\n## Every run\n\n" + table(found)
    (root / "summary.json").write_text(json.dumps(found, indent=1, default=str))
    if len(sys.argv) > 3:  # run_exact.sh's Nemotron-H runs
        exact_root = Path(sys.argv[3])
        found_exact = arms(exact_root, EXACT_ARMS)
        text += "\n" + (HERE / "intro_exact.md").read_text().rstrip() + "\n\n" + table(found_exact)
        (exact_root / "summary.json").write_text(json.dumps(found_exact, indent=1, default=str))
    out_md.write_text(text)
    print(f"wrote {out_md}")


if __name__ == "__main__":
    main()
