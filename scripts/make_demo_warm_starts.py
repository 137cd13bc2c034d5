"""Make the warm starts `unison demo` ships (unison/data/demo/<part>/): for each part the SFT model, its
``sft.json`` and the perfectible set, exactly as ``unison demo --from-scratch`` makes them, with a manifest
(what they depend on, each file's sha256, the SFT's eval accuracies, the CPU and torch that made them).

    .venv/bin/python scripts/make_demo_warm_starts.py              # both parts, made here (≈ 8 min on 2 cores)
    .venv/bin/python scripts/make_demo_warm_starts.py --from collapse=runs/demo-scratch/collapse

``--from PART=DIR`` takes a part already made by ``unison demo --from-scratch --out D`` (DIR = D/PART) or by
``unison sanity`` with the demo's recipe, after checking its config is the demo's (its fingerprint).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from unison.demo import COLLAPSE_RECIPE, PRECISION_STEPS, WARM_STARTS, fingerprint  # noqa: E402
from unison.sanity import sanity_config, warm_start  # noqa: E402

PARTS = {"precision": (PRECISION_STEPS, 32), "collapse": (COLLAPSE_RECIPE, 64)}
K = 8
FILES = ["model/config.json", "model/generation_config.json", "model/model.safetensors", "model/tokenizer.json",
         "model/tokenizer_config.json", "sft.json", "perfectible.jsonl"]


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        flags = next(line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags"))
        feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags]
        return f"{name} ({', '.join(feats)})"
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def ship(part: str, made: Path) -> dict:
    import torch

    dest = WARM_STARTS / part
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    for rel in FILES:
        src = made / ("sft/" + rel if rel.startswith("model/") or rel == "sft.json" else rel)
        shutil.copy(src, tmp / rel)
    steps, prompts = PARTS[part]
    cfg = sanity_config(None, steps)
    manifest = {"part": part, "fingerprint": fingerprint(cfg, K, prompts),
                "files": {rel: hashlib.sha256((tmp / rel).read_bytes()).hexdigest() for rel in FILES},
                "sft": json.loads((tmp / "sft.json").read_text()), "cpu": cpu(), "torch": torch.__version__,
                "made_by": "scripts/make_demo_warm_starts.py (the warm start of `unison demo --from-scratch`)"}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="sources", action="append", default=[], metavar="PART=DIR")
    ap.add_argument("--work", default="runs/demo-warm-starts", help="where parts are made (default: %(default)s)")
    ap.add_argument("--parts", default="precision,collapse")
    args = ap.parse_args()
    given = dict(s.split("=", 1) for s in args.sources)
    for part in args.parts.split(","):
        steps, prompts = PARTS[part]
        cfg = sanity_config(None, steps)
        if part in given:
            made = Path(given[part])
            saved = made / "arms"
            runs = sorted(saved.glob("*/config.yaml")) if saved.exists() else []
            if runs:  # the run's own config: its warm start's inputs must be the demo's
                from unison.config import load_config

                theirs = load_config(runs[0])
                mine = fingerprint(cfg, K, prompts)
                got = fingerprint(theirs.model_copy(update={"model": cfg.model, "seed": cfg.seed}), K, prompts)
                got["task"] = {**got["task"], "path": mine["task"]["path"]}
                if got != mine:
                    raise SystemExit(f"{made} was not made with the demo's recipe: {got} vs {mine}")
        else:
            made = Path(args.work) / part
            warm_start(cfg, made, k=K, max_prompts=prompts)
        m = ship(part, made)
        print(f"{part}: shipped to {WARM_STARTS / part} (SFT eval {m['sft']['eval_accuracy_sampled']:.3f} sampled, "
              f"{m['sft']['eval_accuracy_greedy']:.3f} greedy; {m['cpu']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
