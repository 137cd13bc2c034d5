"""Bad inputs and faults across the CLI (issue 13, "Nothing lost, nothing silent").

Every case runs ``unison.cli.main`` in-process and must: exit 2, print exactly one
stderr line that starts with ``unison: error:`` and names the culprit, print no
traceback, and leave ``--out`` byte-for-byte as it was (absent, a file, or a directory
holding a sentinel). Inputs are tiny and wrong at validation, so each case is fast.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from unison import zoo
from unison.cli import main

# A tiny valid training config: 1-digit addition, 8 prompts, 2-token responses, one step.
BASE_YAML = """\
task: {name: arithmetic, digits: 1, train_size: 8, eval_size: 2}
rollout: {n: 2, max_new_tokens: 2}
train: {steps: 1, prompts_per_step: 4}
sft: {steps: 1, batch_size: 4}
log: {tensorboard: false, console: false}
"""
LATIN1 = "caf\u00e9".encode("latin-1")  # b"caf\xe9": not UTF-8
LONG_PROMPT = "1+" * 600 + "1="     # 1202 characters: the tiny model's context is 1024 tokens


@pytest.fixture(scope="module", autouse=True)
def _warm(tiny_dir):
    """Import the heavy modules and build the tiny model once, outside the timed cases."""
    import unison.filter  # noqa: F401
    import unison.probe  # noqa: F401
    import unison.sanity  # noqa: F401
    import unison.sft  # noqa: F401
    import unison.trainer  # noqa: F401
    from unison.models import load_tokenizer, model_config

    model_config(tiny_dir)
    load_tokenizer(tiny_dir)


class Env:
    """Files a case builds under ``tmp_path``."""

    def __init__(self, root: Path, tiny_dir: Path, monkeypatch):
        self.root, self.tiny_dir, self.monkeypatch = root, tiny_dir, monkeypatch
        self.out = root / "out"

    def file(self, name: str, content: str | bytes) -> str:
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        return str(p)

    def cfg(self, extra: str = "") -> str:
        return self.file("cfg.yaml", BASE_YAML + extra)

    def jsonl(self, name: str, rows: list[dict]) -> str:
        return self.file(name, "".join(json.dumps(r) + "\n" for r in rows))

    def model_copy(self, name: str = "model") -> Path:
        d = self.root / name
        shutil.copytree(self.tiny_dir, d)
        return d

    def run_dir(self, name: str, metrics: bytes) -> Path:
        d = self.root / name
        d.mkdir()
        (d / "config.yaml").write_text("precision: fp32\nalgo: grpo\n")
        (d / "metrics.jsonl").write_bytes(metrics)
        return d

    def out_dir_with_sentinel(self) -> str:
        self.out.mkdir()
        (self.out / "keep.txt").write_text("sentinel\n")
        (self.out / "sub").mkdir()
        (self.out / "sub" / "data.bin").write_bytes(b"\x00\x01")
        return str(self.out)

    def out_file(self) -> str:
        self.out.write_text("I am a file\n")
        return str(self.out)

    def reward_module(self, name: str, source: str) -> None:
        self.file(f"mods/{name}.py", source)
        self.monkeypatch.syspath_prepend(str(self.root / "mods"))


def _row(i: int) -> dict:
    return {"problem": f"What is {i}+1?", "answer": str(i + 1)}


def _metrics(n: int) -> bytes:
    return "".join(json.dumps({"step": i + 1, "reward/mean": 0.5}) + "\n" for i in range(n)).encode()


# Each case: env -> (argv, path whose bytes must not change, text the error line must contain).
CASES = {
    # ------------------------------------------------------------------ probe
    "probe-unknown-precision": lambda e: (
        ["probe", "--precision", "fp32,fp8", "--out", str(e.out)], e.out, "set rollout.quantization=fp8"),
    "probe-unknown-engine": lambda e: (
        ["probe", "--engine", "sglang", "--out", str(e.out)], e.out, "unknown engine 'sglang'"),
    "probe-state-dtype-on-an-attention-model": lambda e: (
        ["probe", "--state-dtype", "model", "--out", str(e.out)], e.out, "--state-dtype=model rounds the recurrent"),
    "probe-state-dtype-on-vllm": lambda e: (
        ["probe", "--state-dtype", "model", "--engine", "vllm", "--out", str(e.out)], e.out,
        "--state-dtype rounds the native engine's recurrent state"),
    "probe-locate-on-vllm": lambda e: (
        ["probe", "--locate", "--engine", "vllm", "--out", str(e.out)], e.out, "--locate reads the engine's hidden"),
    "probe-locate-rows-zero": lambda e: (
        ["probe", "--locate", "--locate-rows", "0", "--out", str(e.out)], e.out, "--locate-rows 0"),
    "probe-missing-model-dir": lambda e: (
        ["probe", "--model", str(e.root / "nope"), "--out", str(e.out)], e.out, "nope' does not exist"),
    "probe-model-dir-without-config": lambda e: (
        ["probe", "--model", str(e.root), "--out", str(e.out)], e.out, "has no config.json"),
    "probe-broken-config-json": lambda e: (
        ["probe", "--model", _broken_model(e), "--out", str(e.out)], e.out, "config.json is not valid JSON"),
    "probe-prompts-not-utf8": lambda e: (
        ["probe", "--prompts", e.file("p.jsonl", b'{"prompt": "' + LATIN1 + b'"}\n'), "--out",
         str(e.out)], e.out, "p.jsonl' is not UTF-8 text (line 1): re-save it as UTF-8"),
    "probe-malformed-jsonl-row": lambda e: (
        ["probe", "--prompts", e.file("p.jsonl", '{"prompt": "a"}\n{oops\n'), "--out", str(e.out)],
        e.out, "p.jsonl:2: not valid JSON"),
    "probe-missing-field": lambda e: (
        ["probe", "--prompts", e.file("p.jsonl", '{"text": "a"}\n'), "--out", str(e.out)],
        e.out, "p.jsonl:1: missing field 'prompt'"),
    "probe-empty-prompts": lambda e: (
        ["probe", "--prompts", e.file("p.jsonl", "\n\n"), "--out", str(e.out)], e.out, "p.jsonl' has no rows"),
    "probe-prompts-is-a-directory": lambda e: (
        ["probe", "--prompts", str(e.root), "--out", str(e.out)], e.out, "is not a file: pass a .jsonl file"),
    "probe-missing-prompts": lambda e: (
        ["probe", "--prompts", str(e.root / "none.jsonl"), "--out", str(e.out)], e.out,
        "none.jsonl' does not exist"),
    "probe-prompt-longer-than-context": lambda e: (
        ["probe", "--prompts", e.jsonl("p.jsonl", [{"prompt": "1+1="}, {"prompt": LONG_PROMPT}]),
         "--max-new-tokens", "4", "--out", e.out_dir_with_sentinel()], e.out, "p.jsonl:2: the prompt has"),
    "probe-prompt-plus-response-longer-than-context": lambda e: (
        ["probe", "--prompts", e.jsonl("p.jsonl", [{"prompt": "1+1="}]), "--max-new-tokens", "1100",
         "--out", str(e.out)], e.out, "--max-new-tokens 1100 that exceeds the model's context of 1024"),
    "probe-temperature-0": lambda e: (
        ["probe", "--temperature", "0", "--out", str(e.out)], e.out, "--temperature 0.0 is invalid"),
    "probe-n-0": lambda e: (["probe", "--n", "0", "--out", str(e.out)], e.out, "--n and --max-new-tokens"),
    "probe-out-is-a-file": lambda e: (
        ["probe", "--n", "1", "--max-new-tokens", "2", "--precision", "fp32", "--out", e.out_file()],
        e.out, "exists and is not a directory"),
    # ------------------------------------------------------------------ train
    "train-unknown-key": lambda e: (
        ["train", e.cfg(), "--set", "train.lrr=1e-5", "--out", str(e.out)], e.out,
        "unknown config key 'train.lrr': did you mean 'train.lr'?"),
    "train-bad-value-type": lambda e: (
        ["train", e.cfg(), "--set", "train.steps=many", "--out", str(e.out)], e.out, "config key 'train.steps'"),
    "train-out-of-range": lambda e: (
        ["train", e.cfg(), "--set", "rollout.temperature=-1", "--out", str(e.out)], e.out,
        "config key 'rollout.temperature'"),
    "train-opd-without-teacher": lambda e: (
        ["train", e.cfg(), "--set", "algo=opd", "--out", str(e.out)], e.out,
        "algo=opd distills from a teacher but distill.teacher is not set"),
    "train-distill-coef-negative": lambda e: (
        ["train", e.cfg(), "--set", "distill.coef=-0.5", "--out", str(e.out)], e.out, "config key 'distill.coef'"),
    "train-distill-teacher-missing": lambda e: (
        ["train", e.cfg(), "--set", "algo=opd", "--set", f"distill.teacher={e.root / 'no-teacher'}", "--out",
         str(e.out)], e.out, "distill.teacher: model directory"),
    "train-distill-sequence-loss": lambda e: (
        ["train", e.cfg(), "--set", "algo=gspo", "--set", "distill.teacher=builtin:tiny", "--out", str(e.out)], e.out,
        "policy.loss=gspo cannot take"),
    "train-missing-config": lambda e: (
        ["train", str(e.root / "none.yaml"), "--out", str(e.out)], e.out, "none.yaml' does not exist"),
    "train-malformed-yaml": lambda e: (
        ["train", e.file("bad.yaml", "train: [1, 2\n"), "--out", str(e.out)], e.out, "bad.yaml' is not valid YAML"),
    "train-yaml-not-utf8": lambda e: (
        ["train", e.file("bad.yaml", BASE_YAML.encode() + b"# " + LATIN1 + b"\n"), "--out", str(e.out)],
        e.out, "bad.yaml' is not UTF-8 text (line 6): re-save it as UTF-8"),
    "train-missing-model-dir": lambda e: (
        ["train", e.cfg(), "--set", f"model={e.root / 'nope'}", "--out", str(e.out)], e.out,
        "nope' does not exist"),
    "train-model-dir-without-config": lambda e: (
        ["train", e.cfg(), "--set", f"model={e.root}", "--out", str(e.out)], e.out, "has no config.json"),
    "train-broken-config-json": lambda e: (
        ["train", e.cfg(), "--set", f"model={_broken_model(e)}", "--out", str(e.out)], e.out,
        "config.json is not valid JSON"),
    "train-unknown-precision": lambda e: (
        ["train", e.cfg(), "--set", "precision=fp8", "--out", str(e.out)], e.out, "set rollout.quantization=fp8"),
    "train-unknown-engine": lambda e: (
        ["train", e.cfg(), "--set", "engine=sglang", "--out", str(e.out)], e.out, "unknown engine 'sglang'"),
    "train-unknown-algo": lambda e: (
        ["train", e.cfg(), "--set", "algo=ppo9", "--out", str(e.out)], e.out, "unknown algo 'ppo9'"),
    "train-unknown-task": lambda e: (
        ["train", e.cfg(), "--set", "task.name=chess", "--out", str(e.out)], e.out, "config key 'task.name'"),
    "train-math-without-path": lambda e: (
        ["train", e.cfg(), "--set", "task.name=math", "--out", str(e.out)], e.out, "task.path is not set"),
    "train-math-file-not-utf8": lambda e: (
        ["train", e.cfg(), "--set", "task.name=math", "--set",
         "task.path=" + e.file("m.jsonl", json.dumps(_row(1)).encode() + b"\n" + b'{"problem": "' + LATIN1
                               + b'", "answer": "1"}\n'), "--out", str(e.out)],
        e.out, "m.jsonl' is not UTF-8 text (line 2)"),
    "train-arithmetic-file-not-utf8": lambda e: (
        ["train", e.cfg(), "--set", "task.path=" + e.file("a.jsonl", b'{"prompt": "' + LATIN1
                                                             + b'", "answer": "1"}\n'), "--out", str(e.out)],
        e.out, "a.jsonl' is not UTF-8 text (line 1)"),
    "train-malformed-jsonl-row": lambda e: (
        ["train", e.cfg(), "--set", "task.name=math", "--set",
         "task.path=" + e.file("m.jsonl", json.dumps(_row(1)) + "\n{oops\n"), "--out", str(e.out)],
        e.out, "m.jsonl:2: not valid JSON"),
    "train-missing-field": lambda e: (
        ["train", e.cfg(), "--set", "task.name=math", "--set",
         "task.path=" + e.jsonl("m.jsonl", [_row(1), {"problem": "2+2?"}]), "--out", str(e.out)],
        e.out, "m.jsonl:2: missing field 'answer'"),
    "train-empty-data-file": lambda e: (
        ["train", e.cfg(), "--set", "task.path=" + e.file("a.jsonl", "\n"), "--out", str(e.out)],
        e.out, "a.jsonl' has no rows"),
    "train-prompt-longer-than-context": lambda e: (
        ["train", e.cfg(), "--set", "task.path=" + e.jsonl("a.jsonl", [{"prompt": LONG_PROMPT, "answer": "601"}]),
         "--set", "train.prompts_per_step=1", "--out", e.out_dir_with_sentinel()],
        e.out, "exceeds the model's context of 1024"),
    "train-prompt-longer-than-context-names-file": lambda e: (
        ["train", e.cfg(), "--set", "task.path=" + e.jsonl("a.jsonl", [{"prompt": "1+1=", "answer": "2"},
                                                                        {"prompt": LONG_PROMPT, "answer": "601"}]),
         "--set", "train.prompts_per_step=2", "--out", str(e.out)], e.out, "a.jsonl:2"),
    "train-reward-module-missing": lambda e: (
        ["train", e.cfg(), "--set", "task.reward=no_such_reward_mod_13:score", "--out", str(e.out)],
        e.out, "cannot import reward module 'no_such_reward_mod_13'"),
    "train-reward-module-syntax-error": lambda e: (
        e.reward_module("broken_reward_13", "def score(resp, item)\n    return 1\n")
        or ["train", e.cfg(), "--set", "task.reward=broken_reward_13:score", "--out", str(e.out)],
        e.out, "reward module 'broken_reward_13' does not import"),
    "train-reward-module-raises-on-import": lambda e: (
        e.reward_module("raising_reward_13", "raise RuntimeError('no config here')\n")
        or ["train", e.cfg(), "--set", "task.reward=raising_reward_13:score", "--out", str(e.out)],
        e.out, "reward module 'raising_reward_13' does not import"),
    "train-reward-function-missing": lambda e: (
        e.reward_module("ok_reward_13", "def score(resp, item):\n    return 1.0\n")
        or ["train", e.cfg(), "--set", "task.reward=ok_reward_13:nope", "--out", str(e.out)],
        e.out, "module 'ok_reward_13' has no function 'nope'"),
    "train-config-is-a-list": lambda e: (
        ["train", e.file("list.yaml", "- 1\n- 2\n"), "--out", str(e.out)], e.out,
        "list.yaml' must hold a mapping of keys"),
    "train-config-is-a-directory": lambda e: (
        ["train", str(e.root), "--out", str(e.out)], e.out, "is a directory: pass a YAML file"),
    "train-section-not-a-mapping": lambda e: (
        ["train", e.file("sec.yaml", "train: 3\n"), "--out", str(e.out)], e.out,
        "config key 'train' must be a section"),
    "train-incompatible-policy": lambda e: (
        ["train", e.cfg(), "--set", "algo=pg_seq_is", "--set", "policy.correction=token_tis", "--out",
         str(e.out)], e.out, "policy.correction 'token_tis' cannot be combined with loss 'pg_seq_is'"),
    "train-math-too-few-training-prompts": lambda e: (
        ["train", e.cfg(), "--set", "task.name=math", "--set",
         "task.path=" + e.jsonl("m.jsonl", [_row(i) for i in range(20)]), "--set", "train.prompts_per_step=19",
         "--out", str(e.out)], e.out, "task.path leaves 18 training prompt(s) after holding out 2"),
    "train-distributed-key-without-torchrun": lambda e: (
        ["train", e.cfg(), "--set", "distributed.timeout_s=5", "--out", str(e.out)], e.out,
        "distributed.timeout_s is set but unison is not running under torchrun"),
    # a quantized KV cache (unison/kvcache.py) where it cannot run
    "train-kv-cache-aware-without-a-cache": lambda e: (
        ["train", e.cfg(), "--set", "train.kv_cache_aware=true", "--out", str(e.out)], e.out,
        "train.kv_cache_aware replays a quantized KV cache, and rollout.kv_cache_dtype is 'auto'"),
    "train-kv-cache-on-vllm": lambda e: (
        ["train", e.cfg(), "--set", "rollout.kv_cache_dtype=fp8_e4m3", "--set", "engine=vllm", "--out", str(e.out)],
        e.out, "rollout.kv_cache_dtype=fp8_e4m3 is the native engine's cache"),
    "train-kv-cache-in-exact-mode": lambda e: (
        ["train", e.cfg(), "--set", "rollout.kv_cache_dtype=fp8_e4m3", "--set", "exact=true", "--out", str(e.out)],
        e.out, "exact mode shares one forward"),
    "train-kv-cache-aware-with-checkpointing": lambda e: (
        ["train", e.cfg(), "--set", "rollout.kv_cache_dtype=fp8_e4m3", "--set", "train.kv_cache_aware=true", "--set",
         "train.activation_checkpointing=true", "--out", str(e.out)], e.out, "set one of them false"),
    "train-kv-cache-on-the-generic-path": lambda e: (
        ["train", e.cfg(), "--set", f"model={zoo.build('gpt2', e.root / 'gpt2')}", "--set",
         "rollout.kv_cache_dtype=fp8_e5m2", "--out", str(e.out)], e.out, "gpt2 decodes through its own forward"),
    "train-lora-all-linear-on-mamba2": lambda e: (
        ["train", e.cfg(), "--set", f"model={zoo.build('mamba2', e.root / 'mamba2')}", "--set", "lora.rank=4",
         "--out", str(e.out)], e.out, "Module 'out_proj' is incompatible with Mamba-based models"),
    "train-state-dtype-on-an-attention-model": lambda e: (
        ["train", e.cfg(), "--set", "rollout.state_dtype=model", "--out", str(e.out)], e.out,
        "rollout.state_dtype=model rounds the recurrent state of a hybrid or state-space model"),
    "train-state-dtype-with-vllm": lambda e: (
        ["train", e.cfg(), "--set", "rollout.state_dtype=model", "--set", "engine=vllm", "--out", str(e.out)], e.out,
        "rollout.state_dtype=model rounds the native engine's recurrent state"),
    "train-bad-set-syntax": lambda e: (
        ["train", e.cfg(), "--set", "train.lr", "--out", str(e.out)], e.out, "--set 'train.lr' is not key=value"),
    "train-out-is-a-file": lambda e: (
        ["train", e.cfg(), "--out", e.out_file()], e.out, "exists and is not a directory"),
    "train-out-holds-other-files": lambda e: (
        ["train", e.cfg(), "--out", e.out_dir_with_sentinel()], e.out, "already holds a run"),
    # ------------------------------------------------------------------ sft
    "sft-unknown-key": lambda e: (
        ["sft", e.cfg(), "--set", "sft.stepz=3", "--out", str(e.out)], e.out, "unknown config key 'sft.stepz'"),
    "sft-math-without-path": lambda e: (
        ["sft", e.cfg(), "--set", "task.name=math", "--out", e.out_dir_with_sentinel()], e.out,
        "task.path is not set"),
    "sft-task-file-not-utf8": lambda e: (
        ["sft", e.cfg(), "--set", "task.path=" + e.file("a.jsonl", b'{"prompt": "' + LATIN1
                                                           + b'", "answer": "1"}\n'), "--out", str(e.out)],
        e.out, "a.jsonl' is not UTF-8 text (line 1)"),
    "sft-broken-config-json": lambda e: (
        ["sft", e.cfg(), "--set", f"model={_broken_model(e)}", "--out", str(e.out)], e.out,
        "config.json is not valid JSON"),
    "sft-missing-model-dir": lambda e: (
        ["sft", e.cfg(), "--set", f"model={e.root / 'nope'}", "--out", str(e.out)], e.out, "nope' does not exist"),
    "sft-out-is-a-file": lambda e: (["sft", e.cfg(), "--out", e.out_file()], e.out, "exists and is not a directory"),
    # ------------------------------------------------------------------ filter
    "filter-band-reversed": lambda e: (
        ["filter", e.cfg(), "--band", "0.9,0.1", "--out", str(e.out)], e.out, "--band '0.9,0.1' must satisfy"),
    "filter-band-not-numbers": lambda e: (
        ["filter", e.cfg(), "--band", "low,high", "--out", str(e.out)], e.out, "--band 'low,high' is not lo,hi"),
    "filter-k-0": lambda e: (["filter", e.cfg(), "--k", "0", "--out", str(e.out)], e.out, "--k 0 is invalid"),
    "filter-out-is-a-directory": lambda e: (
        ["filter", e.cfg(), "--out", e.out_dir_with_sentinel()], e.out, "is a directory: pass a .jsonl file"),
    "filter-math-without-path": lambda e: (
        ["filter", e.cfg(), "--set", "task.name=math", "--out", str(e.out)], e.out, "task.path is not set"),
    "filter-broken-config-json": lambda e: (
        ["filter", e.cfg(), "--set", f"model={_broken_model(e)}", "--out", str(e.out)], e.out,
        "config.json is not valid JSON"),
    "filter-missing-model-dir": lambda e: (
        ["filter", e.cfg(), "--set", f"model={e.root / 'nope'}", "--out", str(e.out)], e.out, "nope' does not exist"),
    # ------------------------------------------------------------------ sanity
    "sanity-unknown-algorithm": lambda e: (
        ["sanity", e.cfg(), "--algorithms", "grpo,ppo9", "--out", e.out_dir_with_sentinel()], e.out,
        "unknown algorithm 'ppo9'"),
    "sanity-math-without-path": lambda e: (
        ["sanity", e.cfg(), "--set", "task.name=math", "--out", str(e.out)], e.out, "task.path is not set"),
    "sanity-math-without-path-existing-out": lambda e: (
        ["sanity", e.cfg(), "--set", "task.name=math", "--out", e.out_dir_with_sentinel()], e.out,
        "task.path is not set"),
    "sanity-unknown-precision": lambda e: (
        ["sanity", e.cfg(), "--precisions", "fp16,fp4", "--out", str(e.out)], e.out, "unknown precision 'fp4'"),
    "sanity-band-bad": lambda e: (
        ["sanity", e.cfg(), "--band", "2,3", "--out", str(e.out)], e.out, "--band '2,3' must satisfy"),
    "sanity-missing-model-dir": lambda e: (
        ["sanity", e.cfg(), "--set", f"model={e.root / 'nope'}", "--out", str(e.out)], e.out,
        "nope' does not exist"),
    "sanity-out-is-a-file": lambda e: (
        ["sanity", e.cfg(), "--out", e.out_file()], e.out, "exists and is not a directory"),
    # ------------------------------------------------------------------ report
    "report-not-a-run-dir": lambda e: (
        ["report", e.out_dir_with_sentinel()], e.out, "is not a run directory (no metrics.jsonl)"),
    "report-no-such-dir": lambda e: (
        ["report", str(e.root / "nope"), "--out", str(e.out)], e.out, "nope' is not a run directory"),
    "report-empty-metrics": lambda e: (
        ["report", str(e.run_dir("run", b""))], e.root / "run",
        "has no training steps in metrics.jsonl: nothing to report"),
    "report-empty-metrics-with-out": lambda e: (
        ["report", str(e.run_dir("run", b"\n")), "--out", str(e.out)], e.out,
        "'" + str(e.root / "run") + "' has no training steps in metrics.jsonl"),
    "report-damaged-middle-line": lambda e: (
        ["report", str(e.run_dir("run", _metrics(2) + b'{"step": 3, "rew\n' + _metrics(1))), "--out",
         str(e.out)], e.out, "metrics.jsonl:3: not valid JSON"),
    "report-metrics-not-utf8": lambda e: (
        ["report", str(e.run_dir("run", _metrics(2) + b'{"step": 3, "x": "' + LATIN1 + b'"}\n'))],
        e.root / "run", "metrics.jsonl' is not UTF-8 text"),
    "report-damaged-config-yaml": lambda e: (
        ["report", str(_damage_config(e.run_dir("run", _metrics(3))))], e.root / "run",
        "config.yaml' is not valid YAML"),
    "report-one-bad-run-of-two": lambda e: (
        ["report", str(e.run_dir("good", _metrics(6))), str(e.run_dir("bad", b"")), "--out", str(e.out)],
        e.out, "bad' has no training steps"),
    "report-out-is-a-file": lambda e: (
        ["report", str(e.run_dir("good", _metrics(6))), "--out", e.out_file()], e.out,
        "exists and is not a directory"),
}

#: cases known to fail today: case -> reason (none)
XFAIL: dict[str, str] = {}


def _broken_model(e: Env) -> str:
    d = e.model_copy("broken_model")
    (d / "config.json").write_text('{"model_type": "llama", ')
    return str(d)


def _damage_config(d: Path) -> Path:
    (d / "config.yaml").write_text("precision: [fp32\n")
    return d


def _snapshot(path: Path):
    """Bytes of a file, {relative path: bytes or None for a directory} of a tree, None if absent."""
    if not path.exists():
        return None
    if path.is_file():
        return path.read_bytes()
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c]))
                                  if c in XFAIL else c for c in CASES])
def test_bad_input_exits_2_with_one_line_and_leaves_out_alone(case, tmp_path, tiny_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a default output path (report/, runs/) would land here
    env = Env(tmp_path, tiny_dir, monkeypatch)
    argv, guarded, expect = CASES[case](env)
    before = _snapshot(guarded)
    cwd_before = sorted(p.name for p in tmp_path.iterdir())
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("unison: error: "), captured.err
    assert expect in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert _snapshot(guarded) == before, f"{guarded} changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == cwd_before, "something new was written"


def test_there_are_at_least_thirty_cases_over_every_command():
    assert len(CASES) >= 30
    assert {c.split("-")[0] for c in CASES} == {"probe", "train", "sft", "filter", "sanity", "report"}
