"""unison against TRL's GRPOTrainer on the same job: seconds per RL step and peak memory, side by side.

Both sides train SmolLM2-135M-Instruct (``builtin:smollm2``, the same local directory, fp32, CPU,
``--threads`` torch threads) with ``n`` = 4 samples per prompt, up to 128 new tokens at temperature 1,
one optimizer step per rollout batch, no reference model (TRL ``beta=0``), no gradient checkpointing on
either side (TRL's default turns it on: ``--trl-gradient-checkpointing`` restores it), on one or both
prompt shapes (``--shapes``):

* ``math``: the first ``--prompts`` problems of ``builtin:sanity_math`` in unison's math template
  (≈ 200-token prompts with the chat template);
* ``chat``: the 8 short built-in prompts of ``unison probe`` (``unison/data/prompts.jsonl``) as they are
  (issue 32's shape: "12+35=", "Once upon a time", ...).

Both go to the model as one user message through its chat template. The reward, the same function on
both sides, pays for length (min(characters, 100) / 100): a weak model earns no task reward, and the
update then still has real gradients. Everything else is each library's default (unison: ``algo=grpo``;
TRL: its default loss). Both children run with the caller's environment, so the same OpenMP wait policy
(libgomp spins unless ``OMP_WAIT_POLICY`` is set: on a quiet machine that costs nothing; with anything
else running, prefix ``OMP_WAIT_POLICY=PASSIVE`` — as ``unison``'s command line does — or both sides
slow down many times); unison's child is told its thread count (``threads=N``), as TRL's calls
``torch.set_num_threads``. The JSON records the environment it ran under.

Each side runs ``--steps`` steps in a fresh process, alternating unison, TRL, unison, TRL... for
``--pairs`` pairs per shape; the first step of each (warm-up) is not counted. Reported per run: the
median wall seconds of the timed steps (unison: around ``Trainer.train_step``; TRL: from
``on_step_begin`` to ``on_step_end`` of a TrainerCallback, which spans generation, scoring and the
update), mean response length in tokens (sampling decides it: compare step times at similar lengths,
hence also the speed-up per response token), and the child's peak RSS (``ru_maxrss``, its own or a
descendant's); per shape, the median over the pairs and ``unison_speedup`` (TRL's step time over
unison's). Prints JSON. TRL is optional and not in the project's venv: install it beside it,

    pip install --no-deps --target /tmp/trlpkgs trl==1.16.0 datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1 \\
        dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
    PYTHONPATH=/tmp/trlpkgs python benchmarks/trl_compare.py [--shapes math,chat] [--pairs 3] [--steps 4]

(``--no-deps`` keeps torch, transformers and accelerate the venv's own.) No network: the model is a
local directory and both children run with the Hugging Face libraries offline. Issue 32's measurement
(median of steps 2–4 of 3 alternating pairs), on 2 cores and 23 GiB:

    PYTHONPATH=/tmp/trlpkgs python benchmarks/trl_compare.py --shapes chat --pairs 3 --steps 4     # ≈ 25 min
    PYTHONPATH=/tmp/trlpkgs python benchmarks/trl_compare.py --shapes math --pairs 3 --steps 4 \\
        --trl-gradient-checkpointing math     # ≈ 1.5 h; without checkpointing TRL did not fit in 23 GiB here
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model  # noqa: E402 - a sibling module (python benchmarks/...)

INSTALL = ("pip install --no-deps --target /tmp/trlpkgs trl==1.16.0 datasets==5.2.0 pandas==3.1.1 "
           "pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

#: the reward both sides use: ``reward`` is unison's signature (task.reward=length_reward:reward),
#: ``trl_reward`` TRL's (a list of completions, each a string or a list of chat messages)
REWARD_MODULE = '''
def reward(response, item=None):
    return min(len(response), 100) / 100


def trl_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [reward(t) for t in texts]
'''

#: shared by both children: the peak RSS of this process or any descendant it waited for, in GiB
PEAK_RSS = '''
def peak_rss_gib():
    import resource
    kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return kib / 2**20
'''

UNISON_CHILD = PEAK_RSS + '''
import json, sys, time
import torch
from unison.config import load_config
from unison.trainer import Trainer
result, out, steps, threads, sets = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
t = Trainer(load_config(None, sets + [f"train.steps={steps}", f"threads={threads}"]), out, log=lambda m: None)
walls, lengths, phases = [], [], []
for _ in range(steps):
    t0 = time.perf_counter()
    m = t.train_step()
    walls.append(time.perf_counter() - t0)
    lengths.append(m["response_length/mean"])
    phases.append({k: round(v, 2) for k, v in m.items() if k.startswith("time/") and isinstance(v, float)})
t.source.close()
with open(result, "w") as f:
    json.dump({"walls": walls, "lengths": lengths, "phases": phases, "peak_rss_gib": peak_rss_gib(),
               "torch_threads": torch.get_num_threads()}, f)
'''

TRL_CHILD = PEAK_RSS + '''
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from length_reward import trl_reward
result, out, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(spec["threads"])
P, n = len(spec["prompts"]), spec["n"]


class StepClock(TrainerCallback):
    def __init__(self):
        self.walls, self.lengths, self.t0 = [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.walls.append(time.perf_counter() - self.t0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:
            self.lengths.append(float(logs["completions/mean_length"]))


tok = AutoTokenizer.from_pretrained(spec["model"])
model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
import pyarrow as pa
# a fixed fingerprint: datasets' own hashing of the table fails with some dill/pyarrow pairs
data = Dataset(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": p}]} for p in spec["prompts"]]),
               fingerprint="unison-trl-compare")
cfg = GRPOConfig(
    output_dir=out, max_steps=spec["steps"], learning_rate=spec["lr"], use_cpu=True, bf16=False, fp16=False,
    per_device_train_batch_size=P * n, gradient_accumulation_steps=1, num_generations=n, num_iterations=1,
    max_completion_length=spec["max_new_tokens"], temperature=1.0, beta=0.0,
    gradient_checkpointing=spec["gradient_checkpointing"], logging_steps=1, report_to="none",
    save_strategy="no", disable_tqdm=True, seed=0)
clock = StepClock()
trainer = GRPOTrainer(model=model, reward_funcs=trl_reward, args=cfg, train_dataset=data, processing_class=tok,
                      callbacks=[clock])
trainer.train()
with open(result, "w") as f:
    json.dump({"walls": clock.walls, "lengths": clock.lengths, "peak_rss_gib": peak_rss_gib(),
               "torch_threads": torch.get_num_threads(),
               "loss_type": cfg.loss_type, "scale_rewards": cfg.scale_rewards,
               "generation_batch_size": cfg.generation_batch_size}, f)
'''


def run_child(name: str, code: str, args: list[str], work: Path) -> dict:
    """``code`` in a fresh interpreter (the benchmark's work dir on PYTHONPATH, Hugging Face offline);
    its result file, or exit with the tail of its log."""
    result, log = work / f"{name}.json", work / f"{name}.log"
    env = {**os.environ, **OFFLINE,
           "PYTHONPATH": os.pathsep.join(p for p in (str(work), os.environ.get("PYTHONPATH", "")) if p)}
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "-c", code, str(result), str(work / name), *args], stdout=f,
                           stderr=subprocess.STDOUT, env=env, timeout=7200)
    if p.returncode or not result.exists():
        raise SystemExit(f"trl_compare: the {name} run failed (exit {p.returncode}), the end of {log}:\n"
                         f"{log.read_text(errors='replace')[-3000:]}")
    return json.loads(result.read_text())


def summarize(r: dict) -> dict:
    """Median of the timed steps (the first is warm-up) and what the child measured."""
    walls, lengths = r["walls"][1:], r["lengths"][1:]
    return {"step_s": round(statistics.median(walls), 2), "steps_timed": len(walls),
            "step_s_each": [round(w, 2) for w in walls],
            "mean_response_tokens": round(statistics.mean(lengths), 1) if lengths else None,
            "peak_rss_gib": round(r["peak_rss_gib"], 2), "torch_threads": r["torch_threads"],
            **({"phases_s": r["phases"][1:]} if "phases" in r else {})}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def shape_prompts(shape: str, count: int, work: Path) -> tuple[list[str], list[str]]:
    """unison's task settings and the user messages TRL gets, for one prompt shape."""
    from unison.data_io import read_jsonl, resolve_data_path
    from unison.data_io import load_prompts
    from unison.tasks.math import MATH_TEMPLATE

    if shape == "chat":
        prompts = load_prompts(None)[:count]
        path = work / "chat_prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
        return ["task.name=jsonl", f"task.path={path}"], prompts
    rows = read_jsonl(resolve_data_path("builtin:sanity_math"), {"problem": str, "answer": (str, int, float)})[:count]
    path = work / "math_prompts.jsonl"
    with open(path, "w", encoding="utf-8") as f:  # unison's task file: the same P rows
        for r in rows:
            f.write(json.dumps({"problem": r["problem"], "answer": str(r["answer"])}) + "\n")
    return ["task.name=math", f"task.path={path}"], [MATH_TEMPLATE.format(problem=r["problem"]) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="math", help="comma-separated prompt shapes: math, chat")
    ap.add_argument("--prompts", type=int, default=8, help="P prompts per step: the first P of the shape's set")
    ap.add_argument("--steps", type=int, default=3, help="RL steps per run, the first one not counted")
    ap.add_argument("--pairs", type=int, default=1, help="unison/TRL runs per shape, alternating")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--model", default="builtin:smollm2", help="a local HF directory or unison's builtin:NAME")
    ap.add_argument("--trl-gradient-checkpointing", nargs="?", const="all", default="", metavar="SHAPES",
                    help="keep TRL's default gradient checkpointing on (unison's default is off): for every shape, "
                         "or for the comma-separated SHAPES")
    ap.add_argument("--also", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="another unison run with these overrides, reported beside the default one "
                         "(e.g. --also train.micro_batch_tokens=1024)")
    ap.add_argument("--no-trl", action="store_true",
                    help="run only unison's arms (the default and each --also), e.g. to try a setting before the "
                         "half-hour comparison; reports each arm's step time against the default's")
    args = ap.parse_args()
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    if not shapes or any(x not in ("math", "chat") for x in shapes):
        ap.error(f"--shapes '{args.shapes}': choose from math, chat")
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is warm-up and is not counted")
    if args.n < 2:
        ap.error("--n must be at least 2: GRPO needs a group to compute advantages")
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.prompts > 8 and "chat" in shapes:
        ap.error("--prompts: the chat shape has 8 prompts")
    checkpointed = set(shapes) if args.trl_gradient_checkpointing == "all" else \
        {x.strip() for x in args.trl_gradient_checkpointing.split(",") if x.strip()}
    if not args.no_trl and importlib.util.find_spec("trl") is None:
        print(f"trl_compare: TRL is not importable: {INSTALL}, then run with PYTHONPATH=/tmp/trlpkgs",
              file=sys.stderr)
        raise SystemExit(2)
    os.environ.update(OFFLINE)

    from unison.errors import UnisonError
    from unison.models import resolve_model_dir

    work = Path(tempfile.mkdtemp(prefix="unison-trl-compare-"))
    (work / "length_reward.py").write_text(REWARD_MODULE)
    try:
        model_dir = str(resolve_model_dir(args.model))
        tasks = {shape: shape_prompts(shape, args.prompts, work) for shape in shapes}
    except UnisonError as e:
        print(f"trl_compare: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for shape, (_, prompts) in tasks.items():
        if len(prompts) < args.prompts:
            ap.error(f"--prompts {args.prompts}: the {shape} set has only {len(prompts)} prompts")

    out = {}
    for shape, (task_sets, prompts) in tasks.items():
        unison_sets = [f"model={model_dir}", "precision=fp32", *task_sets, "task.eval_size=0",
                       f"train.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
                       f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0",
                       "train.mini_batches=1", f"train.lr={args.lr}", "task.reward=length_reward:reward",
                       "task.truncated_reward=null", "log.console=false", "log.tensorboard=false",
                       "checkpoint.every_minutes=0"]
        trl_spec = {"model": model_dir, "prompts": prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
                    "steps": args.steps, "lr": args.lr, "threads": args.threads,
                    "gradient_checkpointing": shape in checkpointed}
        pairs, trl_info = [], {}
        for i in range(args.pairs):
            u = summarize(run_child(f"{shape}-unison-{i}", UNISON_CHILD,
                                    [str(args.steps), str(args.threads), *unison_sets], work))
            if args.no_trl:
                pairs.append({"unison": u})
                continue
            raw = run_child(f"{shape}-trl-{i}", TRL_CHILD, [json.dumps(trl_spec)], work)
            trl_info = {k: raw[k] for k in ("loss_type", "scale_rewards", "generation_batch_size")}
            pairs.append({"unison": u, "trl": summarize(raw)})
        also = {v: summarize(run_child(f"{shape}-unison-also-{j}", UNISON_CHILD,
                                       [str(args.steps), str(args.threads), *unison_sets, *v.split(",")], work))
                for j, v in enumerate(args.also)}
        u_step = statistics.median(p["unison"]["step_s"] for p in pairs)
        if args.no_trl:
            out[shape] = {"pairs": pairs, "unison_step_s": round(u_step, 2), "unison": unison_sets,
                          "unison_also": {v: {**a, "speedup_vs_default": round(u_step / a["step_s"], 2)}
                                          for v, a in also.items()}}
            continue
        t_step = statistics.median(p["trl"]["step_s"] for p in pairs)
        u_tok = statistics.median(p["unison"]["mean_response_tokens"] or 0 for p in pairs)
        t_tok = statistics.median(p["trl"]["mean_response_tokens"] or 0 for p in pairs)
        out[shape] = {
            "trl_gradient_checkpointing": shape in checkpointed, "pairs": pairs,
            "unison_step_s": round(u_step, 2), "trl_step_s": round(t_step, 2),
            "unison_speedup": round(t_step / u_step, 2),
            "unison_speedup_per_response_token": round((t_step / t_tok) / (u_step / u_tok), 2) if u_tok and t_tok else None,
            "unison": unison_sets,
            "trl": {"per_device_train_batch_size": args.prompts * args.n, "gradient_accumulation_steps": 1,
                    "num_generations": args.n, "num_iterations": 1, "beta": 0.0,
                    "gradient_checkpointing": shape in checkpointed, **trl_info},
            **({"unison_also": also} if also else {})}
    print(json.dumps({
        "benchmark": "trl_compare", "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
        "versions": {d: version(d) for d in ("unison", "trl", "torch", "transformers", "accelerate")},
        "settings": {"model": args.model, "model_dir": model_dir, "shapes": shapes, "prompts": args.prompts,
                     "n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "precision": "fp32",
                     "device": "cpu", "torch_threads": args.threads, "lr": args.lr, "steps": args.steps,
                     "pairs": args.pairs, "warmup_steps_not_counted": 1, "reward": "min(len(response), 100) / 100",
                     "environment": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
                                     if k in os.environ}},
        "shapes": out,
        "work_dir": str(work),
    }, indent=2))


if __name__ == "__main__":
    main()
