"""Asynchronous off-policy RL (issue 18): the engine runs up to K versions ahead of the learner.

Native engine in a worker process fed through shared memory; a vLLM server (the stub of its HTTP
API) with requests in flight; the mismatch split into numerics and staleness; faults."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from unison import checkpoint as ckpt
from unison.batch import collate
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.rollout import SamplingParams
from unison.rollout.worker import WeightRing
from unison.trainer import Trainer

BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=8", "train.lr=1e-3",
        "log.console=false", "log.tensorboard=false", "task.reward=char_reward:reward", "task.truncated_reward=null"]
REWARD = "def reward(response, item):\n    return len(response) / 10\n"


@pytest.fixture()
def rewards(tmp_path, monkeypatch):
    (tmp_path / "char_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return tmp_path


def _run(tmp_path, name, *sets, steps=4, resume=False):
    cfg = load_config(None, BASE + [f"train.steps={steps}", *sets])
    Trainer(cfg, tmp_path / name, resume=resume, log=lambda m: None).fit()
    return read_metrics(tmp_path / name / "metrics.jsonl")


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))} for r in rows]


# ------------------------------------------------------------------ the native worker
def test_k1_trains_every_batch_one_version_late_and_is_deterministic(tmp_path, rewards):
    a = _run(tmp_path, "a", "rollout.max_staleness=1")
    b = _run(tmp_path, "b", "rollout.max_staleness=1")
    assert [r["staleness/max"] for r in a] == [0.0, 1.0, 1.0, 1.0]
    assert [r["staleness/mean"] for r in a] == [0.0, 1.0, 1.0, 1.0]
    assert _comparable(a) == _comparable(b)  # stale_policy wait: batch j uses exactly version j − K
    sync = _run(tmp_path, "sync")
    assert _comparable(a)[0] == {**_comparable(sync)[0], **{k: v for k, v in _comparable(a)[0].items()
                                                             if k.startswith("staleness/")}}
    assert a[1]["mismatch/k3"] > 100 * sync[1]["mismatch/k3"]  # a version late is a mismatch of its own


def test_k2_staleness_is_bounded_by_k(tmp_path, rewards):
    rows = _run(tmp_path, "k2", "rollout.max_staleness=2", steps=5)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(r["staleness/dropped"] == 0 for r in rows)


def test_the_mismatch_splits_into_numerics_and_staleness(tmp_path, rewards):
    rows = _run(tmp_path, "split", "rollout.max_staleness=1", "mismatch.decompose_every=1", steps=3)
    for r in rows[1:]:  # fp32: the numerics are rounding, the staleness is the whole mismatch
        assert r["mismatch/numeric_k3"] < 1e-9 < r["mismatch/staleness_k3"]
        assert r["mismatch/staleness_k3"] == pytest.approx(r["mismatch/k3"], rel=1e-4)
        # log π_old − log μ = (log π_old − log π_v) + (log π_v − log μ): k1 adds up exactly
        assert r["mismatch/numeric_k1"] + r["mismatch/staleness_k1"] == pytest.approx(r["mismatch/k1"], abs=1e-6)
    assert rows[0]["mismatch/staleness_k3"] == 0.0  # on-policy: nothing stale
    bf = _run(tmp_path, "bf16", "rollout.max_staleness=1", "precision=bf16", "mismatch.decompose_every=1", steps=2)
    assert bf[1]["mismatch/numeric_k3"] > 1e-7  # bf16 numerics show up as such


def test_bf16_lora_at_zero_staleness_counts_no_staleness_the_merge_is_its_own_term(tmp_path, rewards, monkeypatch):
    # issue 51, item 4: the engine samples merged weights W + BA (bf16), older versions were scored merged and the
    # current one through the adapters — the merge's bf16 rounding (k3 ≈ 3e-4) counted as staleness. At an LR that
    # moves nothing, every version is the same policy: staleness ≈ 0, and the rounding is the merge term. The
    # adapters start trained (B ≠ 0, as the probe's LoRA rows: |BA| = 5% of |W|), else BA = 0 merges exactly
    from unison import lora

    apply = lora.apply

    def trained(model, cfg, base_dir):
        peft = apply(model, cfg, base_dir)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for _, layer in lora._lora_layers(model):
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                b.copy_(torch.randn(b.shape, generator=g))
                b.mul_(0.05 * layer.base_layer.weight.norm() / (layer.scaling["default"] * (b @ a)).norm())
        return peft

    monkeypatch.setattr(lora, "apply", trained)
    rows = _run(tmp_path, "lora", "rollout.max_staleness=1", "precision=bf16", "lora.rank=4", "lora.alpha=8",
                "train.lr=1e-12", "mismatch.decompose_every=1", steps=3)
    for r in rows[1:]:
        assert r["staleness/max"] == 1.0
        assert r["mismatch/staleness_k3"] < 1e-9, r["mismatch/staleness_k3"]
        assert r["mismatch/merge_k3"] > 1e-6  # bf16: the merged weights round otherwise than W and B·A apart
        total = r["mismatch/numeric_k1"] + r["mismatch/staleness_k1"] + r["mismatch/merge_k1"]
        assert total == pytest.approx(r["mismatch/k1"], abs=1e-6)
        assert r["ledger/staleness_k3"] < 1e-9 and r["ledger/merge_k3"] == pytest.approx(r["mismatch/merge_k3"])


def test_weights_reach_the_worker_through_shared_memory():
    shapes = [("a", (2, 3)), ("b", (4,))]
    ring = WeightRing(shapes, slots=2)
    assert all(buf.is_shared() for buf in ring.bufs)
    ring.write(0, [("b", torch.arange(4.0)), ("a", torch.ones(2, 3))])
    ring.write(1, [("a", torch.zeros(2, 3)), ("b", torch.ones(4))])
    assert torch.equal(ring.read(0)["b"], torch.arange(4.0)) and ring.read(1)["a"].sum() == 0
    ring.write(2, [("a", torch.full((2, 3), 2.0)), ("b", torch.zeros(4))])  # slot 0 again
    assert ring.read(0) is None and ring.newest() == 2 and ring.read(2)["a"][0, 0] == 2.0
    view = ring.read(2)["a"]
    assert view.untyped_storage().data_ptr() == ring.bufs[0].untyped_storage().data_ptr()  # a view, no copy


def test_the_worker_samples_what_an_in_process_engine_samples(tmp_path, rewards, tiny_dir):
    t = Trainer(load_config(None, BASE + ["train.steps=1", "rollout.max_staleness=1"]), tmp_path / "r",
                log=lambda m: None)
    from unison.rollout import make_engine

    local = make_engine("native", tiny_dir, torch.float32)
    ids = [t.prompt_ids[0], t.prompt_ids[1]]
    params = SamplingParams(n=3, max_tokens=6, seed=5)
    a = [(c.token_ids, c.logprobs) for c in t.source.generate(ids, params)]
    b = [(c.token_ids, c.logprobs) for c in local.generate(ids, params)]
    assert a == b
    t.source.close()


# ------------------------------------------------------------------ the anchors under staleness
@pytest.mark.parametrize("anchor", ["bypass", "loglinear"])
def test_off_policy_anchors_train(tmp_path, rewards, anchor):
    rows = _run(tmp_path, anchor, "rollout.max_staleness=1", f"policy.anchor={anchor}", "train.mini_batches=2",
                steps=3)
    assert all(r["optim/steps"] == 2 and r["optim/skipped_steps"] == 0 for r in rows)
    assert rows[-1]["staleness/max"] == 1.0


def test_loglinear_on_rows_of_different_lengths_cuts_the_versions_to_each_micro_batch(tmp_path, rewards):
    # prompts of 4 to 18 characters, so a micro-batch without the batch's longest row is narrower than
    # the batch; the per-token versions [B, L] were taken at the batch's width: "size of tensor a (13) must match
    # the size of tensor b (12)" at the first update of a stale sample (issue 51, item 1)
    import json

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+" * n + "1="}) + "\n" for n in range(1, 9)))
    rows = _run(tmp_path, "ll", "rollout.max_staleness=1", "policy.anchor=loglinear", "task.name=jsonl",
                f"task.path={data}", "task.eval_size=0", "train.mini_batches=4", "train.micro_batch_size=2",
                "log.rollouts=true", steps=2)
    widths = {len(json.loads(x)["prompt"]) for x in (tmp_path / "ll" / "rollouts" / "step_000002.jsonl").open()}
    assert len(widths) > 1, widths  # rows of different lengths, or the test cannot fail
    assert [r["optim/steps"] for r in rows] == [4, 4] and rows[-1]["staleness/max"] == 1.0


def test_loglinear_alpha_follows_each_token_on_a_narrow_micro_batch():
    from unison.algorithms.anchors import OldLogp

    v = torch.tensor([[0, 3, 3, 4, 4], [0, 4, 4, 0, 0]])  # per-token versions, batch width 5
    old = OldLogp("loglinear", None, v, step=4, mini_batches=2)
    theta, mu = torch.full((1, 3), -1.0), torch.full((1, 3), -2.0)  # row 1 alone: 3 columns wide
    # mini-batch 1 of 2: v_θ = 4.5; tokens of version 4: α = (4 − 4)/(4.5 − 4) = 0 → log μ; version 0: α = 4/4.5
    got = old(torch.tensor([1]), theta, mu, 1)
    assert got.tolist() == [pytest.approx([-2.0 + 4 / 4.5, -2.0, -2.0])]


def test_dppo_with_bypass_runs_under_staleness(tmp_path, rewards):
    rows = _run(tmp_path, "dppo", "rollout.max_staleness=2", "algo=dppo_tv", "policy.bypass=true", steps=3)
    assert all(0.0 <= r["policy/clip_fraction"] <= 1.0 for r in rows) and rows[-1]["staleness/max"] == 2.0


# ------------------------------------------------------------------ resume and faults
def _prompts(run, step):
    import json

    return sorted(json.loads(x)["prompt"] for x in (run / "rollouts" / f"step_{step:06d}.jsonl").open())


def test_resume_with_dapo_refills_in_flight_equals_the_uninterrupted_run(tmp_path, rewards):
    # the checkpoint keeps the older version the batch in flight is generated with (versions/): the resumed
    # run regenerates that job (prompts and seeds recorded) from it, as the uninterrupted run generated it,
    # and DAPO's refill rounds (prompts drawn between the jobs submitted ahead) follow. The plain loop's
    # resume at K = 1 and 2 is test_async_faults.py's SIGKILL test
    sets = ["rollout.max_staleness=1", "checkpoint.every=2", "log.rollouts=true", "train.drop_uniform_groups=true",
            "train.oversample_rounds=1", "task.truncated_reward=0"]
    full = _run(tmp_path, "full", *sets, steps=4)
    _run(tmp_path, "part", *sets, steps=2)
    kept = tmp_path / "part/checkpoints/step_000002/versions"
    assert [p.name for p in kept.iterdir()] == ["version_000001.safetensors"]  # batch 3 is version 1's (K = 1)
    shutil.copytree(tmp_path / "part", tmp_path / "old")  # as an older unison wrote it: no versions/
    shutil.rmtree(tmp_path / "old/checkpoints/step_000002/versions")
    ckpt.write_manifest(tmp_path / "old/checkpoints/step_000002")
    rows = _run(tmp_path, "part", *sets, steps=4, resume=True)
    assert _comparable(rows) == _comparable(full)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    before = set(_prompts(tmp_path / "part", 1) + _prompts(tmp_path / "part", 2))
    after = set(_prompts(tmp_path / "part", 3) + _prompts(tmp_path / "part", 4))
    assert not before & after  # nothing trained before the checkpoint is trained again (40 prompts: no new epoch)
    assert _same_weights(tmp_path / "part", tmp_path / "full", 4)
    # without the older version the job in flight is regenerated from version 2 instead of 1 (fresher; with
    # DAPO its samples then decide which groups are refilled); nothing trained twice or skipped
    old = _run(tmp_path, "old", *sets, steps=4, resume=True)
    assert [r["staleness/max"] for r in old] == [0.0, 1.0, 0.0, 1.0]
    assert _comparable(old[2:]) != _comparable(full[2:])
    assert not before & set(_prompts(tmp_path / "old", 3) + _prompts(tmp_path / "old", 4))


@pytest.mark.slow  # the DAPO resume test above runs the same older checkpoint through the refill loop
def test_a_checkpoint_without_older_versions_regenerates_the_same_job_fresher(tmp_path, rewards):
    # an older unison's checkpoint (no versions/): the job in flight is the uninterrupted run's, the same
    # prompts (and seeds), regenerated from version 2 (the checkpoint's) instead of version 1
    sets = ["rollout.max_staleness=1", "checkpoint.every=2", "log.rollouts=true"]
    full = _run(tmp_path, "full", *sets, steps=4)
    _run(tmp_path, "old", *sets, steps=2)
    shutil.rmtree(tmp_path / "old/checkpoints/step_000002/versions")
    ckpt.write_manifest(tmp_path / "old/checkpoints/step_000002")
    rows = _run(tmp_path, "old", *sets, steps=4, resume=True)
    assert _prompts(tmp_path / "old", 3) == _prompts(tmp_path / "full", 3)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert _comparable(rows[:2]) == _comparable(full[:2])


def _same_weights(a, b, step):
    from safetensors.torch import load_file

    wa, wb = (load_file(r / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors") for r in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_step_without_an_update_does_not_stall_an_engine_running_ahead(tmp_path, rewards):
    (tmp_path / "flat.py").write_text("def reward(response, item):\n    return 0.0\n")
    rows = _run(tmp_path, "flat", "rollout.max_staleness=1", "task.reward=flat:reward",
                "train.drop_uniform_groups=true", steps=3)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["data/dropped_groups"] == 4 for r in rows)


def test_a_killed_worker_stops_the_run_in_one_line_and_resume_continues(tmp_path, rewards):
    cfg = load_config(None, BASE + ["train.steps=4", "rollout.max_staleness=1", "checkpoint.every=1"])
    t = Trainer(cfg, tmp_path / "r", log=lambda m: None)
    t.runlog.write(t.train_step())
    t.save_checkpoint()
    os.kill(t.source.backend.worker.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(UnisonError, match=r"the rollout worker \(pid \d+\) died .*SIGKILL.*continue with --resume"):
        for _ in range(3):
            t.train_step()
    assert time.monotonic() - start < 60
    t.source.close()
    assert [p.name for p in ckpt.complete(tmp_path / "r" / "checkpoints")] == ["step_000001"]
    rows = _run(tmp_path, "r", "rollout.max_staleness=1", "checkpoint.every=1", steps=4, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


SIGTERM_RUN = textwrap.dedent("""
    import sys
    from unison.cli import main
    sys.exit(main(["train", sys.argv[1], "--out", sys.argv[2]] + sys.argv[3:]))
""")


def test_sigterm_with_batches_in_flight_saves_and_exits_143(tmp_path, rewards):
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("{}\n")
    script = tmp_path / "run.py"
    script.write_text(SIGTERM_RUN)
    sets = [f"--set={s}" for s in BASE + ["train.steps=200", "rollout.max_staleness=1", "log.console=true"]]
    proc = subprocess.Popen([sys.executable, str(script), str(cfgfile), str(tmp_path / "run"), *sets],
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("[train] step 3/200"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, rest
    stops = [x for x in rest.splitlines() if x.startswith("unison: stopped")]
    assert len(stops) == 1 and "checkpoint saved" in stops[0] and "--resume" in stops[0], rest
    assert "Traceback" not in rest
    done = ckpt.complete(tmp_path / "run" / "checkpoints")
    assert done and ckpt.verify(done[-1]) is None
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and done[-1].name == f"step_{steps[-1]:06d}"


# ------------------------------------------------------------------ bad input: one line, nothing written
@pytest.mark.parametrize("sets,match", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    (["rollout.max_staleness=1", "engine=vllm"], "colocated vLLM shares its device"),
    (["rollout.max_staleness=1", "exact=true"], "exact mode needs the engine and the learner to hold equal weights"),
    (["rollout.max_staleness=1", "rollout.stale_policy=never"], "rollout.stale_policy"),
])
def test_async_bad_input_is_refused_before_writing(tmp_path, sets, match):
    with pytest.raises(UnisonError, match=match):
        Trainer(load_config(None, BASE + ["train.steps=1", *sets]), tmp_path / "run", log=lambda m: None)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ a vLLM server (the HTTP stub)
def _server_cfg(url, *extra):
    return load_config(None, BASE + ["engine=vllm", "vllm.mode=server", f"vllm.url={url}", "train.steps=3",
                                     "rollout.max_staleness=1", *extra])


def _stub(model_dir, **kw):
    from unison.models import load_tokenizer
    from unison.rollout.vllm_server import PROBE_TEXT
    from vllm_stub import StubServer

    tok = load_tokenizer(model_dir)
    return StubServer(str(model_dir), list(tok(PROBE_TEXT)["input_ids"]), len(tok), **kw)


def test_server_requests_run_ahead_and_syncs_wait_between_batches(tmp_path, rewards, tiny_dir):
    with _stub(tiny_dir) as stub:
        Trainer(_server_cfg(stub.url), tmp_path / "r", log=lambda m: None).fit()
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]
    assert stub.reloads == 4 and set(stub.pause_modes) == {"wait"}  # version 0 before the first batch, then 3


def test_a_resumed_server_run_keeps_its_versions(tmp_path, rewards, tiny_dir):
    with _stub(tiny_dir) as stub:
        Trainer(_server_cfg(stub.url, "train.steps=2"), tmp_path / "r", log=lambda m: None).fit()
        Trainer(_server_cfg(stub.url, "train.steps=5"), tmp_path / "r", resume=True, log=lambda m: None).fit()
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness/dropped"] == 0 and r["staleness/max"] <= 1 for r in rows)


def test_server_drop_policy_syncs_in_flight_and_drops_what_is_too_stale(tmp_path, rewards, tiny_dir, monkeypatch):
    # a weight sync that reaches the server only after the learner has moved on: the engine samples with weights
    # older than the bound allows. Held on an event the learner's second step sets — not on a delay that must be
    # slower than a step (that failed on a busy machine: issue 41)
    import threading

    from unison.rollout.vllm_server import VLLMServerEngine

    released = threading.Event()
    apply = VLLMServerEngine.apply_sync

    def held(self, prepared, in_flight=False, version=None):
        if version:  # version 0 reaches the server before the first batch; later ones wait for step 2
            assert released.wait(timeout=120), "the learner never reached step 2"
        return apply(self, prepared, in_flight=in_flight, version=version)

    monkeypatch.setattr(VLLMServerEngine, "apply_sync", held)
    with _stub(tiny_dir) as stub:
        t = Trainer(_server_cfg(stub.url, "rollout.stale_policy=drop", "train.steps=4"), tmp_path / "r",
                    log=lambda m: None)
        t.on_step = lambda m: m["step"] >= 2 and released.set()
        t.fit()
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert "abort" in stub.pause_modes  # weights reached the server with requests in flight
    assert sum(r["staleness/dropped"] for r in rows) > 0
    assert all(r["staleness/max"] is None or r["staleness/max"] <= 1.0 for r in rows if "staleness/max" in r)


def test_staleness_counts_each_token_from_the_version_that_sampled_it():
    """Two responses at step 5: one wholly sampled by version 3, one whose first token version 3 sampled and the
    next two version 4 (a sync reached it mid-way). Per token the staleness is 2, 2 | 2, 1, 1: mean 8/5, max 2;
    half the responses span a sync. The batch keeps each token's version, the row its first."""
    from unison.batch import Completion
    from unison.telemetry import batch_metrics

    comps = [Completion([1, 2], [3, 4], [-0.1, -0.2], "stop", version=3),
             Completion([1], [6, 7, 8], [-0.3, -0.4, -0.5], "stop", sample_index=1, token_versions=[3, 4, 4])]
    assert comps[1].versions == (3, 4) and comps[1].version == 3 and comps[0].versions_of_tokens() == [3, 3]
    batch = collate(comps, 0)
    batch.rewards = torch.tensor([1.0, 0.0])
    assert batch.version.tolist() == [3, 3]
    # prompt and padding positions hold the row's first version
    assert batch.token_version.tolist() == [[3, 3, 3, 3], [3, 3, 4, 4]]
    assert batch.spanning().tolist() == [False, True]
    m = batch_metrics(batch, 5)
    assert m["staleness/spanning_fraction"] == 0.5
    assert m["staleness/mean"] == pytest.approx(8 / 5) and m["staleness/max"] == 2.0
    # a row of one version only: the same numbers as without per-token versions
    plain = collate([comps[0]], 0)
    plain.rewards = torch.zeros(1)
    assert plain.token_version is None and batch_metrics(plain, 5)["staleness/mean"] == 2.0
    # scoring by version: each position from the weights that sampled it (a scorer that answers its version)
    from unison.batch import by_version

    seen = []
    got = by_version(batch, lambda part, u: seen.append((u, part.size)) or torch.full(part.tokens.shape, float(u)))
    assert seen == [(3, 2), (4, 1)]  # version 3 scores both rows, version 4 only the row that holds its tokens
    assert got.tolist() == [[3.0] * 4, [3.0, 3.0, 4.0, 4.0]]
    kept = by_version(batch, lambda part, u: torch.full(part.tokens.shape, float(u)), out=torch.full((2, 4), -1.0),
                      skip={3})
    assert kept.tolist() == [[-1.0] * 4, [-1.0, -1.0, 4.0, 4.0]]  # skipped versions keep ``out``'s values
    with pytest.raises(ValueError, match="must not decrease"):
        Completion([1], [6, 7], [-0.3, -0.4], "stop", token_versions=[4, 3])
    with pytest.raises(ValueError, match="same length"):
        Completion([1], [6, 7], [-0.3, -0.4], "stop", token_versions=[4])
