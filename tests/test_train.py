"""`unison train` end to end on the built-in tiny model, checkpoints and exact resume."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from unison.cli import main
from unison.config import load_config
from unison.trainer import Trainer, read_metrics

BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=8", "train.lr=1e-4",
        "log.console=false", "log.tensorboard=false"]

CONTRACT = [
    "mismatch/k1", "mismatch/k2", "mismatch/k3", "mismatch/seq_kl", "mismatch/prob_diff_mean",
    "mismatch/prob_diff_max", "mismatch/log_ppl_diff", "mismatch/log_ppl_abs_diff", "mismatch/ppl_ratio",
    "mismatch/chi2_token", "mismatch/chi2_seq", "correction/ratio_max", "correction/ratio_min",
    "correction/weight_mean", "correction/masked_fraction", "correction/ess", "reward/mean",
    "response_length/mean", "response_length/max", "response/truncated_fraction", "optim/lr",
    "optim/grad_norm", "optim/loss_scale", "optim/skipped_steps", "policy/loss", "policy/clip_fraction",
    "policy/entropy", "time/rollout_s", "time/score_s", "time/update_s", "time/sync_s", "time/step_s",
    "throughput/tokens_per_s",
]


def _run(tmp_path, name, extra, steps, resume=False):
    cfg = load_config(None, BASE + [f"train.steps={steps}"] + extra)
    return Trainer(cfg, tmp_path / name, resume=resume).fit(), tmp_path / name


@pytest.mark.parametrize("precision,steps", [("fp32", 3), ("bf16", 2), ("fp16", 2)])
def test_train_runs_per_precision_with_contract_metrics(tmp_path, precision, steps):
    summary, run = _run(tmp_path, precision, [f"precision={precision}", "algo=grpo_token_tis",
                                              "train.eval_every=2"], steps)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        missing = [k for k in CONTRACT if k not in r]
        assert not missing, missing
        assert r["optim/skipped_steps"] == 0
    assert "eval/accuracy" in rows[1]
    scale = rows[-1]["optim/loss_scale"]
    assert scale == (2.0**16 if precision == "fp16" else 1.0)
    k3 = rows[0]["mismatch/k3"]
    assert (k3 < 1e-9) if precision == "fp32" else (k3 > 1e-7)
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "plots/training_curves.png"):
        assert (run / f).exists(), f
    assert (run / "checkpoints" / f"step_{steps:06d}" / "model" / "config.json").exists()
    assert summary["steps"] == steps


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))} for r in rows]


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    _, full = _run(tmp_path, "full", ["checkpoint.every=2"], 4)
    _, part = _run(tmp_path, "part", ["checkpoint.every=2"], 2)
    _run(tmp_path, "part", ["checkpoint.every=2"], 4, resume=True)
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert _comparable(a) == _comparable(b)


def test_sigkill_mid_checkpoint_leaves_previous_loadable(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from unison.config import load_config
        from unison.trainer import Trainer
        cfg = load_config(None, {BASE!r} + ["train.steps=3", "checkpoint.every=1"])
        t = Trainer(cfg, {str(tmp_path / 'run')!r})
        t.train_step(); t.save_checkpoint()
        t.train_step()
        torch.save = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        t.save_checkpoint()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "step_000001" / "trainer_state.pt").exists()
    assert any(p.name.startswith(".tmp-") for p in ck.iterdir())  # the interrupted one
    cfg = load_config(None, BASE + ["train.steps=3", "checkpoint.every=1"])
    t = Trainer(cfg, tmp_path / "run", resume=True)
    assert t.step == 1 and not any(p.name.startswith(".tmp-") for p in ck.iterdir())


def test_train_cli_refuses_bad_input_without_touching_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "-", "--out", str(run)]
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("train:\n  steps: 1\n")
    args[1] = str(cfgfile)
    assert main(args + ["--set", "train.lrr=1"]) == 2
    assert "did you mean 'train.lr'" in capsys.readouterr().err and not run.exists()
    assert main(args + ["--set", "model=/no/such/model"]) == 2
    assert "does not exist" in capsys.readouterr().err and not run.exists()
    assert main(args + [f"--set={s}" for s in BASE]) == 0
    before = (run / "metrics.jsonl").read_text()
    assert main(args + [f"--set={s}" for s in BASE] + ["--set", "seed=5"]) == 2
    assert "different config" in capsys.readouterr().err
    assert main(args + [f"--set={s}" for s in BASE] + ["--set", "seed=5", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "differs from the run's config.yaml at seed (0 -> 5)" in err
    assert (run / "metrics.jsonl").read_text() == before


def test_context_overflow_is_refused(tmp_path):
    cfg = load_config(None, BASE + ["rollout.max_new_tokens=5000"])
    from unison.errors import UnisonError

    with pytest.raises(UnisonError, match="exceeds the model's context"):
        Trainer(cfg, tmp_path / "r")


def test_sft_writes_a_loadable_model(tmp_path):
    assert main(["sft", "--out", str(tmp_path / "s"), "--set", "sft.steps=20", "--set", "task.digits=1",
                 "--set", "task.train_size=40", "--set", "task.eval_size=10",
                 "--set", "rollout.max_new_tokens=4"]) == 0
    s = json.loads((tmp_path / "s" / "sft.json").read_text())
    assert 0.0 <= s["eval_accuracy_sampled"] <= 1.0 and s["final_loss"] < 4.0
    from unison.models import load_model

    assert load_model(tmp_path / "s" / "model").config.model_type == "llama"


def test_dapo_drops_uniform_groups_and_counts_them(tmp_path):
    # the untrained model never answers right: every group is all-zero and dropped,
    # and oversampling tries one more round of 4 prompts
    cfg = load_config(None, BASE + ["train.steps=1", "train.drop_uniform_groups=true",
                                    "train.oversample_rounds=1"])
    t = Trainer(cfg, tmp_path / "r")
    roll = t.source.next(0)
    assert (roll.completions, roll.rewards, roll.dropped_groups, roll.rounds) == ([], [], 8, 2)
    assert roll.sampled_rewards == [0.0] * 32  # everything sampled is still accounted for
    assert t.source.sampler.pos == 8
    m = t.train_step()  # a step with nothing left makes no update and says so
    assert m["data/dropped_groups"] == 8 and t.step == 1


def test_tensorboard_event_files_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = load_config(None, BASE + ["train.steps=1", "log.tensorboard=true"])
    Trainer(cfg, tmp_path / "r").fit()
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("algo", ["grpo_seq_mis", "gspo", "pg_seq_is", "pg_seq_mis", "pg_token_is"])
def test_every_preset_trains_three_steps(tmp_path, algo):
    # grpo and grpo_token_tis run in the per-precision test above
    summary, run = _run(tmp_path, algo, [f"algo={algo}", "precision=fp32"], 3)
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 3 and summary["steps"] == 3
    for r in rows:
        assert not [k for k in CONTRACT if k not in r]
        assert all(v is None or isinstance(v, (int, float)) for v in r.values())
        assert r["optim/skipped_steps"] == 0 and math.isfinite(r["policy/loss"])


def test_bypass_mode_skips_the_score_pass_and_still_measures(tmp_path):
    _, run = _run(tmp_path, "bypass", ["policy.bypass=true", "precision=bf16"], 1)
    r = read_metrics(run / "metrics.jsonl")[0]
    assert r["time/score_s"] < 1e-3
    assert r["mismatch/k3"] > 1e-7  # from the first mini-batch's forward
    assert r["correction/ratio_max"] == 1.0  # π_old := μ, so every ρ_t is exactly 1


def test_grad_noise_and_surge_schedule_in_the_loop(tmp_path, monkeypatch):
    # the untrained model earns no task reward; a custom reward paying for characters gives
    # the responses of a group different rewards, hence a non-zero gradient to measure
    (tmp_path / "char_reward.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = ["train.micro_batch_size=2", "train.schedule=surge_decay", "train.surge.trigger_step=1",
             "train.surge.k=1.0", "checkpoint.every=2", "task.reward=char_reward:reward",
             "task.truncated_reward=null"]
    _, run = _run(tmp_path, "gn", extra, 3)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["optim/lr"] for r in rows] == pytest.approx([1e-4, 2.5e-5, 1.25e-5])  # step t: γ^t (t > t_s = 1)
    assert [r["lr_schedule/phase"] for r in rows] == [2, 2, 2] and rows[0]["lr_schedule/surge_step"] == 1
    for r in rows:
        for k in ("noise_scale", "noise_scale_ema", "trace_sigma", "grad_sq", "small_sq", "big_sq"):
            assert isinstance(r[f"grad_noise/{k}"], float), k
        assert r["grad_noise/small_sq"] > r["grad_noise/big_sq"] > 0  # averaging shrinks the norm
    # one micro-batch per optimizer step: no estimate, no crash
    _, run1 = _run(tmp_path, "gn1", ["train.micro_batch_size=64"], 1)
    assert "grad_noise/noise_scale" not in read_metrics(run1 / "metrics.jsonl")[0]


def test_grad_noise_terms_are_unscaled_in_fp16(tmp_path, monkeypatch):
    (tmp_path / "char_reward.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _, run = _run(tmp_path, "fp16", ["precision=fp16", "train.micro_batch_size=2", "task.reward=char_reward:reward",
                                    "task.truncated_reward=null"], 1)
    r = read_metrics(run / "metrics.jsonl")[0]
    assert r["optim/loss_scale"] == 2.0**16
    # micro-batch norms are measured on scaled gradients; forgetting to unscale would make
    # small_sq ~4e9 times big_sq
    assert 1.0 < r["grad_noise/small_sq"] / r["grad_noise/big_sq"] < 100.0


def test_token_budget_micro_batches_equal_padded_ones_within_fp32_rounding(tmp_path):
    """Rows grouped by length into micro-batches of at most 40 tokens, each cut to its own longest row:
    the same samples and rewards, losses and gradient norms equal to fp32 rounding."""
    extra = ["train.steps=3", "rollout.max_new_tokens=8", "train.mini_batches=2"]
    _, padded = _run(tmp_path, "padded", extra + ["train.micro_batch_tokens=null"], 3)
    _, budget = _run(tmp_path, "budget", extra + ["train.micro_batch_tokens=40"], 3)
    a, b = read_metrics(padded / "metrics.jsonl"), read_metrics(budget / "metrics.jsonl")
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"] and x["response_length/mean"] == y["response_length/mean"]
        for k in ("policy/loss", "optim/grad_norm", "mismatch/k3"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-9), k


def test_token_budget_groups_rows_by_length_within_both_limits():
    from unison.batch import Completion, collate
    from unison.learner import Learner

    lens = [9, 2, 7, 3, 3, 8, 1, 5]
    comps = [Completion(prompt_ids=[1], token_ids=[2] * (n - 1), logprobs=[0.0] * (n - 1), finish_reason="stop")
             for n in lens]
    b = collate(comps, pad_id=0)
    learner = Learner.__new__(Learner)
    learner.dist, learner.exact = __import__("unison.distributed", fromlist=["current"]).current(), None
    learner.micro_batch_size, learner.micro_batch_tokens = 3, 16
    learner.packing = False
    groups = [g.tolist() for g in learner._shares(torch.arange(len(lens)), b)[0]]
    # longest first: 9 (+8 would be 2 x 9 = 18 > 16), 8+7 (2 x 8 = 16), 5+3+3 (3 x 5 = 15), 2+1
    assert [[lens[i] for i in g] for g in groups] == [[9], [8, 7], [5, 3, 3], [2, 1]]
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))  # every row exactly once
    learner.micro_batch_tokens = 12
    padded = [[lens[i] for i in g] for g in learner._shares(torch.arange(len(lens)), b)[0]]
    assert padded == [[9], [8], [7], [5, 3], [3, 2, 1]]  # 2 x 7 = 14 > 12, 3 x 5 = 15 > 12
    learner.packing = True  # packed rows hold their own tokens only: 7 + 5 = 12 fits
    packed = [[lens[i] for i in g] for g in learner._shares(torch.arange(len(lens)), b)[0]]
    assert packed == [[9], [8], [7, 5], [3, 3, 2], [1]]


def test_packed_micro_batches_equal_padded_ones_within_fp32_rounding(tmp_path):
    extra = ["train.steps=2", "rollout.max_new_tokens=8", "train.mini_batches=2", "train.micro_batch_tokens=60"]
    _, padded = _run(tmp_path, "padded", extra, 2)
    _, packed = _run(tmp_path, "packed", extra + ["train.packing=true"], 2)
    a, b = read_metrics(padded / "metrics.jsonl"), read_metrics(packed / "metrics.jsonl")
    for x, y in zip(a, b):
        assert x["reward/mean"] == y["reward/mean"]
        for k in ("policy/loss", "optim/grad_norm", "mismatch/k3", "policy/entropy"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-9), k
