"""Tiny-model runs whose metrics are pinned bit for bit: a restructuring of the loop must not change a number.

Five short runs cover the loop's stages (synchronous with a score pass and fused, K = 1 asynchronous, int4 rollout
with the quantization-aware learner, a multi-turn task with a tool, LoRA), each with the mismatch ledger on every
step. Their metrics (timings and memory aside) and a digest of the final weights are compared with the values recorded at commit 428456d on the same
kind of CPU: rounding follows the CPU's kernels, so a reference holds for the CPU it was recorded on
(``tests/data/pinned/<cpu>.json``, keyed by the CPU model, its flags and torch's version); on another CPU the test
is skipped and says how to record one. Record: ``UNISON_PIN_WRITE=1 pytest tests/test_pinned.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
from pathlib import Path

import pytest
import torch

from unison.config import load_config
from unison.data_io import read_metrics
from unison.trainer import Trainer

PINS = Path(__file__).parent / "data" / "pinned"

BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=1e-3", "log.console=false",
        "log.tensorboard=false", "mismatch.decompose_every=1", "checkpoint.every_minutes=0", "threads=1"]

RUNS = {
    "sync-score": ["train.mini_batches=2", "algo=grpo_token_tis"],
    "sync-fused": ["train.mini_batches=1", "algo=grpo"],
    "async-k1": ["train.mini_batches=2", "rollout.max_staleness=1", "rollout.worker_threads=1",
                 "algo=grpo_token_tis"],
    "int4-qat": ["train.mini_batches=2", "rollout.quantization=int4", "rollout.quant_group_size=32",
                 "train.quantization_aware=true"],
    "multi-turn": ["task.name=calculator", "task.train_size=24", "task.eval_size=4", "task.operators=[\"*\"]",
                   "rollout.max_new_tokens=12", "train.mini_batches=2"],
    "lora": ["train.mini_batches=2", "lora.rank=4", "lora.alpha=8"],
}
STEPS = 3


def cpu_key() -> str:
    """The CPU model, a hash of its flags and torch's version: what decides the kernels' rounding."""
    model, flags = platform.processor() or "cpu", ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", info).group(1).strip()
    except (OSError, AttributeError):
        pass
    digest = hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9]+', '-', model).strip('-')}-{digest}-torch{torch.__version__.split('+')[0]}"


def _comparable(rows) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/", "staleness/wait"))}
            for r in rows]


def _weights_digest(model_dir: Path) -> str:
    """sha256 over the final checkpoint's tensors (name, dtype, shape, bytes), in name order."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _run(tmp_path: Path, name: str) -> list[dict]:
    cfg = load_config(None, BASE + RUNS[name] + [f"train.steps={STEPS}"])
    Trainer(cfg, tmp_path / name).fit()
    rows = _comparable(read_metrics(tmp_path / name / "metrics.jsonl"))
    rows[-1]["final_weights_sha256"] = _weights_digest(tmp_path / name / "checkpoints" / f"step_{STEPS:06d}" / "model")
    return rows


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("name", list(RUNS))
def test_pinned_run_is_bit_identical_to_its_reference(tmp_path, name):
    path = PINS / f"{cpu_key()}.json"
    rows = _run(tmp_path, name)
    if os.environ.get("UNISON_PIN_WRITE"):
        PINS.mkdir(parents=True, exist_ok=True)
        refs = json.loads(path.read_text()) if path.exists() else {}
        refs[name] = rows
        path.write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")
        return
    if not path.exists():
        pytest.skip(f"no pinned reference for this CPU ({cpu_key()}): record one at a commit you trust with "
                    f"UNISON_PIN_WRITE=1 pytest tests/test_pinned.py")
    ref = json.loads(path.read_text()).get(name)
    if ref is None:
        pytest.skip(f"no pinned reference for run {name} on this CPU")
    assert len(rows) == len(ref)
    for step, (got, want) in enumerate(zip(rows, ref), 1):
        missing = sorted(set(want) - set(got))
        assert not missing, f"step {step}: metrics gone: {missing}"
        diff = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
        assert not diff, f"step {step}: {diff}"
