"""The CUDA and vLLM-on-GPU paths, checked where a CPU can show them (issue 20): a fake vLLM module, the
HTTP stub of ``vllm serve``, a fake device. None of this is a GPU run; it keeps the first one from
failing on what a desk check found."""

import sys
import types

import pytest
import torch

from unison.cli import main
from unison.config import load_config
from unison.errors import UnisonError
from unison.rollout import server_nccl, vllm_engine
from unison.rollout.vllm_engine import VLLMEngine, check_vllm
from unison.sync import sync, weight_update
from unison.policy import ScoringOptions


# 1 — the vLLM release is pinned and checked -------------------------------------------------------
@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", False),
                                        ("0.10.2", False)])
def test_only_the_vllm_release_the_engines_are_written_for_is_accepted(version, ok):
    if ok:
        check_vllm(version)
    else:
        with pytest.raises(UnisonError, match=rf"written for vLLM 0.32.x and this is vLLM {version}.*vllm==0.32.0"):
            check_vllm(version)


def test_the_vllm_extra_pins_that_release():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'vllm = ["vllm==0.32.0"]' in text


# a fake vLLM: records what unison asks of it --------------------------------------------------------
class FakeLLM:
    instances: list = []

    def __init__(self, **kw):
        self.kw, self.calls = kw, []
        hf = types.SimpleNamespace(eos_token_id=2)
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf),
                                                engine_core=types.SimpleNamespace(shutdown=lambda: self.calls.append("shutdown")))
        FakeLLM.instances.append(self)

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append(f"wake:{','.join(tags) if tags else 'all'}")

    def collective_rpc(self, method, kwargs):
        it = kwargs["weights_iterator"]
        self.calls.append(("reload", type(it).__name__, sum(1 for _ in it)))

    def reset_prefix_cache(self):
        self.calls.append("reset")


@pytest.fixture()
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.__version__ = "0.32.0"
    mod.LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setattr(vllm_engine, "_quiet_vllm", lambda: None)
    FakeLLM.instances.clear()
    return mod


def _engine(tiny_dir, **kw):
    return VLLMEngine(tiny_dir, dtype=torch.bfloat16, device="cuda", **kw)


class _Learner:
    def export_weights(self, dtype):
        return ((f"w{i}", torch.zeros(2, dtype=torch.float32)) for i in range(3))

    def export_shapes(self):
        return [(f"w{i}", (2,)) for i in range(3)]


# 5, 9 — memory, context, device ------------------------------------------------------------------
def test_colocated_vllm_sleeps_by_default_on_gpus_and_reserves_only_the_runs_context(fake_vllm, tiny_dir):
    e = _engine(tiny_dir, max_len=300)
    kw = FakeLLM.instances[-1].kw
    assert kw["enable_sleep_mode"] is True and kw["gpu_memory_utilization"] == 0.6
    assert kw["max_model_len"] == 300  # not the model's whole context
    assert e.sleep_mode
    e2 = _engine(tiny_dir, max_len=300, enable_sleep_mode=False, max_model_len=4096)
    kw2 = FakeLLM.instances[-1].kw
    assert kw2["gpu_memory_utilization"] == 0.3 and kw2["max_model_len"] == 4096 and not e2.sleep_mode


def test_a_device_index_a_colocated_vllm_cannot_honour_is_refused(fake_vllm, tiny_dir):
    with pytest.raises(UnisonError, match="CUDA_VISIBLE_DEVICES=1 and device=cuda"):
        VLLMEngine(tiny_dir, dtype=torch.bfloat16, device="cuda:1")


def test_close_shuts_the_engine_down(fake_vllm, tiny_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    e = _engine(tiny_dir)
    llm = FakeLLM.instances[-1]
    e.close()
    assert "shutdown" in llm.calls and e.llm is None


# 6 — weights stream into the reload ----------------------------------------------------------------
def test_weights_stream_into_vllms_reload(fake_vllm, tiny_dir):
    e = _engine(tiny_dir)
    assert e.load_weights(_Learner().export_weights(None)) == 3
    assert ("reload", "generator", 3) in FakeLLM.instances[-1].calls  # no list of every tensor at once


# 10 — sleep level 2 ---------------------------------------------------------------------------------
def test_sleep_level_2_wakes_weights_reloads_then_wakes_the_cache(fake_vllm, tiny_dir):
    from unison.rollout import SamplingParams

    e = _engine(tiny_dir, sleep_level=2)
    llm = FakeLLM.instances[-1]
    e.sleep()
    e.wake()  # after the update: level 2 leaves the waking to the sync
    with pytest.raises(UnisonError, match="slept at level 2 and holds no weights until the next sync"):
        e.generate([[1, 2]], SamplingParams(max_tokens=2))
    sync(e, _Learner())
    assert llm.calls == ["sleep2", "wake:weights", ("reload", "generator", 3), "reset", "wake:kv_cache"]
    assert not e.asleep


def test_sleep_level_1_wakes_everything_after_the_update(fake_vllm, tiny_dir):
    e = _engine(tiny_dir, sleep_level=1)
    llm = FakeLLM.instances[-1]
    e.sleep()
    e.wake()
    assert llm.calls == ["sleep1", "wake:all"] and not e.asleep


# 2 — the NCCL weight transfer is checked at start-up ------------------------------------------------
def _stub(model_dir, **kw):
    from unison.models import load_tokenizer
    from unison.rollout.vllm_server import PROBE_TEXT
    from vllm_stub import StubServer

    tok = load_tokenizer(model_dir)
    return StubServer(str(model_dir), list(tok(PROBE_TEXT)["input_ids"]), len(tok), **kw)


def _server(url, model_dir, **kw):
    from unison.rollout.vllm_server import VLLMServerEngine

    return VLLMServerEngine(model_dir, url=url, weight_sync="nccl", retries=0, **kw)


def test_nccl_sync_needs_vllm_installed_here(tiny_dir, monkeypatch):
    def missing():
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(server_nccl, "_local_transfer_engine", missing)
    with _stub(tiny_dir) as stub:
        with pytest.raises(UnisonError, match="needs vLLM 0.32 installed here too"):
            _server(stub.url, tiny_dir)


@pytest.mark.parametrize("stub_kw,match", [
    ({"dev_mode": False}, "start it with VLLM_SERVER_DEV_MODE=1"),
    ({}, "has no weight-transfer config"),
])
def test_nccl_sync_needs_a_dev_mode_server_with_a_transfer_config(tiny_dir, monkeypatch, stub_kw, match):
    monkeypatch.setattr(server_nccl, "_local_transfer_engine", lambda: None)
    with _stub(tiny_dir, **stub_kw) as stub:
        with pytest.raises(UnisonError, match=match):
            _server(stub.url, tiny_dir)


def test_nccl_sync_needs_an_address_the_server_can_reach(tiny_dir, monkeypatch):
    import socket

    monkeypatch.setattr(server_nccl, "_local_transfer_engine", lambda: None)
    info = {"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}}
    with _stub(tiny_dir, server_info=info) as stub:
        remote = stub.url.replace("127.0.0.1", "localhost")
        with socket.socket() as busy:  # the transfer's port is taken on this machine
            busy.bind(("127.0.0.1", 0))
            monkeypatch.setenv("UNISON_WEIGHT_SYNC_PORT", str(busy.getsockname()[1]))
            with pytest.raises(UnisonError, match="cannot listen on 127.0.0.1"):
                _server(remote, tiny_dir)
        monkeypatch.delenv("UNISON_WEIGHT_SYNC_PORT")
        monkeypatch.setenv("UNISON_WEIGHT_SYNC_ADDR", "127.0.0.1")
        from urllib.parse import urlparse as real

        monkeypatch.setattr("urllib.parse.urlparse", lambda u: types.SimpleNamespace(hostname="gpu-node-7"))
        with pytest.raises(UnisonError, match="ask the server at gpu-node-7 to connect to 127.0.0.1"):
            _server(stub.url, tiny_dir)
        monkeypatch.setattr("urllib.parse.urlparse", real)
        assert _server(stub.url, tiny_dir).weight_sync == "nccl"  # everything in place: accepted


# 3, 13 — CUDA on a CPU-only torch, exact mode on CUDA -------------------------------------------------
def test_device_cuda_on_a_cpu_only_torch_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("device: cuda\n")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available (this torch is a CPU-only build)" in err[0]
    assert not (tmp_path / "r").exists()
    assert main(["probe", "--device", "cuda", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device is 'cuda' but CUDA is not available" in err[0]


def test_exact_mode_on_cuda_is_refused_in_one_line(tmp_path, monkeypatch):
    from unison import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UnisonError, match="exact mode is built for CPUs: cuBLAS picks kernels by shape"):
        preflight.check_settings(load_config(None, ["exact=true", "device=cuda"]))
    from unison.probe import ProbeConfig, validate

    with pytest.raises(UnisonError, match="--exact is built for CPUs"):
        validate(ProbeConfig(device="cuda", exact=True))


# 8 — the CUDA peak-memory metric is per step ----------------------------------------------------------
def test_cuda_peak_memory_is_reset_after_each_read(monkeypatch):
    from unison.runlog import memory_metrics

    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: resets.append(d))
    m = memory_metrics(torch.device("cuda", 0))
    assert m["memory/cuda_max_allocated_gib"] == 3.0 and resets == [torch.device("cuda", 0)]


# 7 — the server's sync probe is compared at temperature 1 ------------------------------------------
def test_the_server_sync_probe_scores_at_temperature_1(tiny_dir):
    from unison.learner import Learner

    learner = Learner(tiny_dir, options=ScoringOptions(temperature=0.6))
    with _stub(tiny_dir) as stub:
        from unison.rollout.vllm_server import VLLMServerEngine

        eng = VLLMServerEngine(tiny_dir, url=stub.url, weight_sync="disk", sync_dir=None, retries=0)
        t1 = weight_update(eng, learner).probe_logprobs
        assert learner.temperature == 0.6  # the probe's temperature is the call's, not left on the learner
        learner.temperature = 1.0
        assert t1 == weight_update(eng, learner).probe_logprobs  # the raw model's, as the server's prompt log-probs


# issue 30 ----------------------------------------------------------------------------------------------
# 9, 10 — the probe closes its engines (in a finally) and gives vLLM the run's context
def test_each_probe_arm_closes_its_engine_before_the_next_is_built(tmp_path, monkeypatch):
    from unison import probe

    events, real = [], probe.make_engine

    def make(name, model_dir, side, **kw):
        engine = real(name, model_dir, side, **kw)
        events.append(("built", str(side.dtype), kw.get("max_len")))
        engine.close = lambda: events.append(("closed", str(side.dtype)))
        return engine

    monkeypatch.setattr(probe, "make_engine", make)
    (tmp_path / "p.jsonl").write_text('{"prompt": "12+35="}\n{"prompt": "Once upon a time"}\n')
    cfg = probe.ProbeConfig(prompts=str(tmp_path / "p.jsonl"), precisions=["fp32", "bf16"], n=1, max_new_tokens=3)
    width = max(len(p) for p in probe.validate(cfg).prompt_ids)
    probe.run_probe(cfg, log=lambda m: None)
    assert events == [("built", "torch.float32", width + 3), ("closed", "torch.float32"),
                      ("built", "torch.bfloat16", width + 3), ("closed", "torch.bfloat16")]


def test_a_failing_probe_still_closes_its_vllm_engine_which_reserved_only_the_runs_context(fake_vllm, monkeypatch):
    from unison.probe import ProbeConfig, run_probe, validate

    def generate(self, prompts, params):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(VLLMEngine, "generate", generate)
    cfg = ProbeConfig(engines=["vllm"], precisions=["bf16"], n=1, max_new_tokens=7)
    width = max(len(p) for p in validate(cfg).prompt_ids)
    with pytest.raises(RuntimeError, match="sampling failed"):
        run_probe(cfg, log=lambda m: None)
    llm = FakeLLM.instances[-1]
    assert "shutdown" in llm.calls  # closed on the way out: the next precision's engine would find the GPU free
    assert llm.kw.get("max_model_len") == width + 7  # not the model's whole context


# 11 — LoRA + vllm.weight_sync nccl: the transfer announces what it sends (merged weights, base names)
def test_the_nccl_weight_transfer_of_a_lora_learner_announces_the_merged_base_named_weights(tiny_dir, monkeypatch):
    from dataclasses import dataclass

    from unison.config import LoRAConfig
    from unison.learner import Learner

    record = {}

    @dataclass(frozen=True)
    class ParamMeta:  # vllm/distributed/weight_transfer/base.py (0.32.0)
        name: str
        dtype: torch.dtype
        shape: tuple

    class Transfer:  # what vLLM 0.32's NCCL trainer engine checks of a WeightSource (nccl_engine._checked_iter)
        def __init__(self, source):
            self.source = source

        def send_weights(self):
            meta = [(m.name, m.dtype, m.shape) for m in self.source.metadata()]
            sent = [(n, t.dtype, tuple(t.shape)) for n, t in self.source]
            record.update(meta=meta, sent=sent)
            if meta != sent:
                raise ValueError("WeightSource metadata() disagrees with iteration")

        def shutdown(self):
            pass

    class Factory:
        @staticmethod
        def trainer_init(info, client, source):
            record["world_size"] = info.world_size
            return Transfer(source)

    parts = {"vllm.distributed.weight_transfer.base": {"ParamMeta": ParamMeta, "WeightSource": object},
             "vllm.distributed.weight_transfer.clients": {"HTTPVLLMWeightSyncClient": lambda url, timeout: None},
             "vllm.distributed.weight_transfer.factory": {"WeightTransferTrainerFactory": Factory},
             "vllm.distributed.weight_transfer.nccl_engine": {
                 "NCCLTrainerInitInfo": lambda **kw: types.SimpleNamespace(**kw)}}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer", *parts):
        mod = types.ModuleType(name)
        mod.__dict__.update(parts.get(name, {}))
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(server_nccl, "_local_transfer_engine", lambda: None)
    learner = Learner(tiny_dir, lora=LoRAConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"]))
    info = {"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}}
    with _stub(tiny_dir, server_info=info) as stub:
        eng = _server(stub.url, tiny_dir, dtype=torch.bfloat16)
        sync(eng, learner)
    names = [n for n, _, _ in record["sent"]]
    assert record["meta"] == record["sent"] and record["world_size"] == 2
    assert names == [n for n, _ in learner.export_shapes()]
    assert not any("lora_" in n or "base_layer" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names and all(d == torch.bfloat16 for _, d, _ in record["sent"])
    assert {"POST /pause", "POST /resume"} <= set(stub.calls)


# 12 — a torchrun job destroys its process group when its run ends
def test_a_torchrun_train_destroys_its_process_group_at_the_end(tmp_path, monkeypatch):
    import signal
    import socket

    import torch.distributed as tdist

    from unison import distributed
    from unison.trainer import Trainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    during, real_fit = [], Trainer.fit

    def fit(self):
        during.append(self.dist.enabled and tdist.is_initialized())
        return real_fit(self)

    monkeypatch.setattr(Trainer, "fit", fit)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        sets = ["task.digits=1", "task.train_size=8", "task.eval_size=0", "rollout.n=2", "rollout.max_new_tokens=3",
                "train.prompts_per_step=2", "train.steps=1", "log.console=false", "log.tensorboard=false"]
        cfg = tmp_path / "c.yaml"
        cfg.write_text("seed: 0\n")
        assert main(["train", str(cfg), "--out", str(tmp_path / "r"), *[x for s in sets for x in ("--set", s)]]) == 0
        assert during == [True]  # the run was a job with a process group (FSDP2 on one gloo rank) ...
        assert not tdist.is_initialized() and not distributed.current().enabled  # ... destroyed at its end
    finally:
        signal.signal(signal.SIGTERM, handler)
        if tdist.is_initialized():
            tdist.destroy_process_group()
        monkeypatch.setattr(distributed, "_CURRENT", distributed.Dist())
