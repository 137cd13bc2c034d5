"""torchrun + FSDP2 on 2 CPU ranks (gloo) against one process. Run with: make test-distributed.

Every test launches real ``torchrun`` jobs of the tiny model; a reward that pays for
characters gives the groups different rewards, hence real gradients to compare.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from unison import gemm
from unison.data_io import read_metrics

pytestmark = pytest.mark.distributed

CONFIG = """\
task: {digits: 1, train_size: 40, eval_size: 8, reward: "char_reward:reward", truncated_reward: null}
rollout: {n: 4, max_new_tokens: 6}
train: {prompts_per_step: 4, mini_batches: 2, micro_batch_size: 4, lr: 1.0e-3, steps: 3}
log: {console: false, tensorboard: false, rollouts: true}
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def env(tmp_path):
    (tmp_path / "char_reward.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    (tmp_path / "c.yaml").write_text(CONFIG)
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def _torchrun(args, env, n=2, timeout=240, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-port", str(_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def _train(env, tmp_path, out, sets=(), n=2, resume=False, torchrun=True):
    args = ["-m", "unison", "train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / out)]
    args += [f"--set={s}" for s in sets] + (["--resume"] if resume else [])
    if torchrun:
        return _torchrun(args, env, n=n)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, env=env)


def _tokens(run):
    return {p.name: [r["token_ids"] for r in map(json.loads, p.read_text().splitlines())]
            for p in sorted((run / "rollouts").glob("*.jsonl"))}


def _weights(run, step):
    from safetensors.torch import load_file

    return load_file(run / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


@pytest.mark.parametrize("packing,qat", [(False, False), (True, False), (False, True)],
                         ids=["padded", "packed", "quantization-aware"])
def test_two_ranks_equal_one_process_in_fp32(env, tmp_path, packing, qat):
    """Two FSDP2 ranks give one process's samples, metrics and weights; with ``packing`` the two ranks
    run packed rows (one attention call per response) against the one process's padded rows; with
    ``qat`` both run int4 rollout with a quantization-aware learner (each rank quantizes the weight
    FSDP gathered for the layer)."""
    quant = ["rollout.quantization=int4", "train.quantization_aware=true"] if qat else []
    one = _train(env, tmp_path, "one", ["train.micro_batch_size=4", *quant], torchrun=False)
    assert one.returncode == 0, one.stderr
    two = _train(env, tmp_path, "two", ["distributed.param_dtype=fp32", "train.micro_batch_size=2",
                                        f"train.packing={str(packing).lower()}", *quant])
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("done:") == 1  # rank 0 alone speaks
    a, b = read_metrics(tmp_path / "one/metrics.jsonl"), read_metrics(tmp_path / "two/metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert _tokens(tmp_path / "one") == _tokens(tmp_path / "two")  # identical samples, every step
    # quantization-aware: the forward rounds every weight to an int4 step, so once the two runs' fp32 masters
    # differ by an ulp (FSDP's reduction order, from step 1's update on) a weight on a rounding boundary lands
    # in the next bin and moves the forward by a whole step. Measured (AMD EPYC): steps 1-2 at fp32 agreement,
    # step 3 entropy 5e-5 relative apart, grad norm 9e-4, weights 1.5e-4. Step 1 (same weights in) is held to
    # fp32 agreement; later steps, where a flip can come first on another CPU, to 1e-2.
    for ra, rb in zip(a, b):
        rel = 1e-2 if qat and ra["step"] >= 2 else 1e-5
        assert ra["reward/mean"] == rb["reward/mean"] and ra["response_length/mean"] == rb["response_length/mean"]
        for k in ("optim/grad_norm", "policy/entropy", "policy/clip_fraction"):
            assert rb[k] == pytest.approx(ra[k], rel=rel), (k, ra["step"])
        if rel > 1e-5:
            continue
        # ppo_kl is k1, mean(log π_old − log π_θ): a difference of log-probs ~−2 that differ by ~1e-2, so
        # fp32 rounding of each (~1e-7) is ~1e-5 of it (measured on a busy CI machine: 1.8e-5 relative)
        assert rb["policy/ppo_kl"] == pytest.approx(ra["policy/ppo_kl"], rel=1e-5, abs=1e-6)
        # the loss is a sum of terms of both signs (−7.9e-5 at step 2 from terms ~1e-2): fp32 order
        assert rb["policy/loss"] == pytest.approx(ra["policy/loss"], rel=1e-5, abs=1e-7)
        # micro-batches are global (4 rows on each rank = 8): 2 per optimizer step, as in one process
        assert rb["grad_noise/big_sq"] == pytest.approx(ra["grad_noise/big_sq"], rel=1e-4)
        assert ra["optim/grad_norm"] > 0 and ra["policy/loss"] != 0  # a real gradient was compared
        # fp32 k3 is rounding noise (~1e-12): equal to that level, not to 1e-5 of itself
        assert rb["mismatch/k3"] == pytest.approx(ra["mismatch/k3"], rel=1e-5, abs=1e-11)
    wa, wb = _weights(tmp_path / "one", 3), _weights(tmp_path / "two", 3)
    assert set(wa) == set(wb)
    for k in wa:  # per tensor, |Δ| / |w| (measured: ≤ 2e-7; Adam amplifies rounding where g ≈ 0)
        assert float((wb[k] - wa[k]).norm() / wa[k].norm()) < (1e-3 if qat else 1e-5), k
    assert any(not torch.equal(wa[k], v) for k, v in _initial_weights().items())  # training moved them


def _initial_weights():
    from safetensors.torch import load_file

    from unison.models import builtin_model_dir

    return load_file(builtin_model_dir("tiny") / "model.safetensors")


def test_low_precision_trains_on_two_ranks_and_compute_params_match_the_engine(env, tmp_path):
    k3 = {}
    for prec, pd in [("bf16", "compute"), ("bf16", "fp32"), ("fp16", None)]:
        out = f"{prec}-{pd}"
        r = _train(env, tmp_path, out, [f"precision={prec}", "train.steps=2"]
                   + ([f"distributed.param_dtype={pd}"] if pd else []))
        assert r.returncode == 0, r.stderr
        rows = read_metrics(tmp_path / out / "metrics.jsonl")
        assert len(rows) == 2
        for row in rows:
            assert row["optim/skipped_steps"] == 0 and row["optim/grad_norm"] > 0
            assert row["optim/loss_scale"] == (2.0**16 if prec == "fp16" else 1.0)
        k3[out] = max(row["mismatch/k3"] for row in rows)
    # parameters all-gathered in the compute dtype compute as the native engine does (half weights, no autocast,
    # the same attention: unison/attention.py): measured k3 ~2e-14 in bf16 against ~3e-4 for fp32 parameters under
    # autocast, on CPUs with bf16 kernels (AMD Zen 4, Intel Xeon with AMX); 1.0e-4 when the engine attended in fp32
    # and the learner by torch's bf16 kernel. fp16 where the CPU has fp16 kernels (the Xeon) is as close.
    # On a CPU without kernels for the dtype (gemm's half route, both sides: fp32 products rounded once), an engine's
    # decode step multiplies a few rows where the learner multiplies the whole batch, and BLAS sums 1-5 rows in
    # another order than a larger product's same rows; a few of those last-bit differences survive the rounding:
    # fp16 on Zen 4 measured 4.9-6.5e-8 (1.5-1.8e-6 while the ranks that receive their weights did not route).
    # bf16 on such a CPU (AVX2-only) is not measured: bounded as fp16's ratio to its autocast figure (~1e-2).
    assert k3["bf16-compute"] < (0.1 if gemm.half_route(torch.bfloat16) else 1e-3) * k3["bf16-fp32"]
    assert k3["fp16-None"] < (5e-7 if gemm.half_route(torch.float16) else 1e-9)  # the default is compute


def test_an_inf_in_one_ranks_shard_skips_the_step_everywhere(env, tmp_path):
    script = tmp_path / "inf.py"
    script.write_text(textwrap.dedent(f"""
        import json, math, torch
        from unison.config import load_config
        from unison.distributed import current, local_tensor
        from unison.trainer import Trainer
        cfg = load_config({str(tmp_path / 'c.yaml')!r}, ["precision=fp16", "train.mini_batches=1", "train.steps=2"])
        t = Trainer(cfg, {str(tmp_path / 'run')!r})
        scaler, d = t.learner.scaler, current()
        orig = scaler.unscale_
        def poisoned(opt):
            if d.rank == 1 and t.step == 0:
                g = local_tensor(t.learner.params[3].grad)
                g.view(-1)[0] = float("inf")
            return orig(opt)
        scaler.unscale_ = poisoned
        m1 = t.train_step()
        m2 = t.train_step()
        # one file per rank: two ranks printing to the shared stdout can land on one line
        with open({str(tmp_path)!r} + f"/rank{{d.rank}}.json", "w") as f:
            json.dump({{"rank": d.rank, "skipped": [m1["optim/skipped_steps"], m2["optim/skipped_steps"]],
                       "scale": [m1["optim/loss_scale"], m2["optim/loss_scale"]]}}, f)
    """))
    r = _torchrun([str(script)], env)
    assert r.returncode == 0, r.stderr
    out = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert sorted(o["rank"] for o in out) == [0, 1]
    for o in out:  # both ranks skipped the poisoned step and halved the scale; the next step ran
        assert o["skipped"] == [1, 1] and o["scale"] == [2.0**15, 2.0**15]


def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(env, tmp_path):
    sets = ["distributed.param_dtype=fp32", "train.steps=5", "checkpoint.every=1"]
    full = _train(env, tmp_path, "full", sets)
    assert full.returncode == 0, full.stderr
    args = ["-m", "unison", "train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "cut")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           *args, *[f"--set={s}" for s in sets]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.time() + 200
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # every rank and the launcher, mid-run
    proc.wait(timeout=30)
    assert len(read_metrics(metrics)) < 5
    res = _train(env, tmp_path, "cut", sets, resume=True)
    assert res.returncode == 0, res.stderr
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))}  # noqa: E731
                          for r in rows]
    assert strip(read_metrics(metrics)) == strip(read_metrics(tmp_path / "full" / "metrics.jsonl"))


def test_bad_input_and_a_dying_rank_fail_cleanly(env, tmp_path):
    # a world size that does not divide the prompt groups: one line, nothing written
    r = _train(env, tmp_path, "bad", ["train.prompts_per_step=3"])
    assert r.returncode != 0 and "unison: error (rank 0): train.prompts_per_step=3 is not divisible" in r.stderr
    assert not _our_frames(r.stderr) and not (tmp_path / "bad").exists()  # (torchrun adds its own summary)
    # distributed keys without torchrun
    r = _train(env, tmp_path, "bad", ["distributed.param_dtype=fp32"], torchrun=False)
    assert r.returncode == 2 and "not running under torchrun" in r.stderr and not (tmp_path / "bad").exists()
    # a rank that dies mid-run: the job ends (no hang) and says why
    (tmp_path / "dying.py").write_text(textwrap.dedent("""
        import os
        def reward(response, item):
            if os.environ.get("RANK") == "1" and os.path.exists(os.environ["DIE_FLAG"]):
                os._exit(7)
            return len(response) / 10
    """))
    flag = tmp_path / "die"
    flag.write_text("")
    t0 = time.time()
    r = _train(dict(env, DIE_FLAG=str(flag)), tmp_path, "dies", ["task.reward=dying:reward"])
    assert r.returncode != 0 and time.time() - t0 < 120
    assert "exitcode  : 7" in r.stderr  # torchrun names the rank that died and its exit code
    # rank 0 says in one line why it stops: its collective broke, or torchrun stopped it
    assert ("unison: error (rank 0): lost the other ranks" in r.stderr
            or "unison: stopped (rank 0): torchrun ended this rank (SIGTERM: another rank failed" in r.stderr)
    assert not _our_frames(r.stderr)


def _our_frames(stderr: str) -> list[str]:
    """Traceback frames in unison's own code (torchrun's launcher prints its own)."""
    return [x for x in stderr.splitlines() if x.strip().startswith("File ") and "/unison/" in x]


def test_a_checkpoint_resumes_on_another_world_size(env, tmp_path):
    # weights are stored whole (HF directory) and the optimizer with torch.distributed.checkpoint,
    # keyed by parameter name: 2 ranks -> 1 rank -> 2 ranks continues the 2-rank run
    sets = ["distributed.param_dtype=fp32", "train.steps=2"]
    assert _train(env, tmp_path, "run", sets).returncode == 0
    r = _train(env, tmp_path, "run", sets[:1] + ["train.steps=3"], n=1, resume=True)
    assert r.returncode == 0 and "resumed from step_000002" in r.stderr, r.stderr
    r = _train(env, tmp_path, "run", sets[:1] + ["train.steps=4"], resume=True)
    assert r.returncode == 0, r.stderr
    ref = _train(env, tmp_path, "ref", sets[:1] + ["train.steps=4"])
    assert ref.returncode == 0, ref.stderr
    a, b = read_metrics(tmp_path / "run/metrics.jsonl"), read_metrics(tmp_path / "ref/metrics.jsonl")
    assert [x["reward/mean"] for x in a] == [x["reward/mean"] for x in b]
    assert [x["optim/grad_norm"] for x in a] == pytest.approx([x["optim/grad_norm"] for x in b], rel=1e-5)


def test_each_rank_generates_its_own_groups_and_their_union_is_one_process(env, tmp_path):
    script = tmp_path / "gen.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from unison.config import load_config
        from unison.distributed import current
        from unison.trainer import Trainer
        cfg = load_config({str(tmp_path / 'c.yaml')!r}, ["train.steps=2", "train.prompts_per_step=8"])
        t = Trainer(cfg, sys.argv[1])
        seen, orig = [], t.engine.generate
        def recording(prompts, params):
            out = orig(prompts, params)
            seen.append([[c.prompt_ids, c.token_ids] for c in out])
            return out
        t.engine.generate = recording
        t.fit()
        with open(sys.argv[1] + f"-rank{{current().rank}}.json", "w") as f:
            json.dump(seen, f)
    """))
    one = subprocess.run([sys.executable, str(script), str(tmp_path / "one")], capture_output=True, text=True,
                         env=env, timeout=240)
    assert one.returncode == 0, one.stderr
    two = _torchrun([str(script), str(tmp_path / "two")], env)
    assert two.returncode == 0, two.stderr
    load = lambda p: json.loads(p.read_text())  # noqa: E731
    single = load(tmp_path / "one-rank0.json")
    r0, r1 = load(tmp_path / "two-rank0.json"), load(tmp_path / "two-rank1.json")
    for step in range(2):
        prompts0 = {tuple(p) for p, _ in r0[step]}
        prompts1 = {tuple(p) for p, _ in r1[step]}
        assert len(r0[step]) == len(r1[step]) == 16  # 4 prompts x 4 samples on each rank
        assert r0[step] + r1[step] == single[step]  # rank 0's groups then rank 1's: one process's step
        assert len(prompts0) == len(prompts1) == 4 and prompts0.isdisjoint(prompts1)  # disjoint groups


def test_only_rank_0_reads_the_weights_and_every_rank_gets_them(env, tmp_path):
    """The learner loads once per job: the other ranks build the model on the meta device and receive
    their shards (and the rotary buffers) from rank 0."""
    script = tmp_path / "load.py"
    script.write_text(textwrap.dedent("""
        import json, os, torch
        import unison.learner as L
        import unison.policy as P
        from unison.config import load_config
        from unison.distributed import current, init_distributed, full_tensor
        from unison.models import builtin_model_dir, load_model
        calls = []
        real = P.load_model
        P.load_model = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        init_distributed("cpu")
        d = builtin_model_dir("tiny")
        learner = L.Learner.from_config(load_config(None, ["train.steps=1"]), d, current())
        ref = load_model(d)
        same = all(torch.equal(full_tensor(p.detach()), ref.state_dict()[n]) for n, p in learner.model.named_parameters())
        bufs = all(torch.equal(b, dict(ref.named_buffers())[n]) for n, b in learner.model.named_buffers())
        with open(os.environ["OUT"] + f"/rank{current().rank}.json", "w") as f:
            json.dump({"loads": len(calls), "same": same, "buffers": bufs}, f)
    """))
    out = _torchrun([str(script)], {**env, "OUT": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["loads"] for r in ranks] == [1, 0]
    assert all(r["same"] and r["buffers"] for r in ranks)


def test_quantization_aware_in_bf16_gathers_fp32_masters_and_refuses_compute_gathering(env, tmp_path):
    """QAT quantizes the weight FSDP2 gathers: in bf16 the default gathers the fp32 masters (what the engine
    quantizes), so two ranks carry one process's mismatch (bf16's level, not int4's); distributed.param_dtype=compute
    (bf16 gathering: other scales and codes than the engine's) is refused in one line, exit 2, nothing written."""
    quant = ["precision=bf16", "rollout.quantization=int4", "train.quantization_aware=true", "train.steps=2"]
    bad = _train(env, tmp_path, "bad", [*quant, "distributed.param_dtype=compute"])
    assert bad.returncode != 0 and "unison: error (rank 0): train.quantization_aware quantizes the weight FSDP2" \
        in bad.stderr and "distributed.param_dtype=fp32" in bad.stderr
    assert not _our_frames(bad.stderr) and not (tmp_path / "bad").exists()
    one = _train(env, tmp_path, "one", ["train.micro_batch_size=4", *quant], torchrun=False)
    two = _train(env, tmp_path, "two", ["train.micro_batch_size=2", *quant])
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    a, b = read_metrics(tmp_path / "one/metrics.jsonl"), read_metrics(tmp_path / "two/metrics.jsonl")
    # step 1 (same weights, same samples): the same forward numerics on both sides, within bf16's own noise
    assert a[0]["reward/mean"] == b[0]["reward/mean"]
    assert b[0]["mismatch/k3"] == pytest.approx(a[0]["mismatch/k3"], rel=0.05)
    assert a[0]["mismatch/k3"] < 1e-2  # int4's own mismatch on this model is ~0.2: the quantizer is shared


def test_m2po_masks_the_same_tokens_on_two_ranks_as_in_one_process(env, tmp_path):
    """M2PO's mask is over the whole batch's tokens: every rank computes it from the gathered score pass, so two
    ranks apply (and log) one process's mask."""
    sets = ["rollout.quantization=int4", "algo=grpo_m2po", "policy.correction_c=0.002", "train.steps=2"]
    one = _train(env, tmp_path, "one", ["train.micro_batch_size=4", *sets], torchrun=False)
    two = _train(env, tmp_path, "two", ["distributed.param_dtype=fp32", "train.micro_batch_size=2", *sets])
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    a, b = read_metrics(tmp_path / "one/metrics.jsonl"), read_metrics(tmp_path / "two/metrics.jsonl")
    assert 0 < a[0]["correction/m2_masked_fraction"] < 1
    assert a[0]["correction/m2_masked_fraction"] == b[0]["correction/m2_masked_fraction"]
    assert b[0]["optim/grad_norm"] == pytest.approx(a[0]["optim/grad_norm"], rel=1e-5)
