"""Asynchronous mode under faults (issue 31): real process kills, signals to the whole process group,
results of several MiB (over a pipe's 64 KiB), a stub vLLM server that pauses, fails and is slow.

Each test names the item of the issue it pins; each failed on 1d553e3."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import fake_worker
from unison import checkpoint as ckpt
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.rollout import SamplingParams
from unison.rollout.worker import EngineWorker
from unison.trainer import Trainer
from unison.sync import weight_update, weights_of

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=8", "train.lr=1e-3",
        "log.console=false", "log.tensorboard=false", "task.reward=char_reward:reward", "task.truncated_reward=null"]
REWARD = "def reward(response, item):\n    return len(response) / 10\n"


@pytest.fixture(autouse=True)
def _no_report(monkeypatch):
    """The run's report is not what these tests check (its plots take 1–3 s a run here)."""
    import unison.report

    monkeypatch.setattr(unison.report, "write_report", lambda *a, **k: None)


@pytest.fixture()
def rewards(tmp_path, monkeypatch):
    (tmp_path / "char_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _env(*paths) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, paths), str(ROOT), str(TESTS)]),
                OMP_NUM_THREADS="1")


def _in_time(fn, seconds: float):
    """``fn()``'s result or exception, or a failure when it has not returned within ``seconds`` (a hang)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds:.0f} s (a hang)"
    return box


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "unison-rollout-worker" and p.is_alive()]


def _worker(**kw) -> EngineWorker:
    w = EngineWorker(fake_worker.spec(**kw), [("a", (4,)), ("b", (4,))], slots=2)
    w.publish(0, [("a", torch.zeros(4)), ("b", torch.zeros(4))])
    return w


# ------------------------------------------------------------------ the native worker: hangs and crashes
def test_3_a_worker_killed_mid_result_stops_the_collect_instead_of_hanging(tmp_path):
    marker = tmp_path / "generated"
    w = _worker(payload_mib=8, marker=str(marker))
    try:
        w.submit(1, [[1, 2]], SamplingParams(n=4, max_tokens=2), 0)
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the worker never generated"
            time.sleep(0.05)
        time.sleep(1.0)  # the 8 MiB result is being written; the pipe holds 64 KiB of it
        os.kill(w.pid, signal.SIGKILL)
        t0 = time.monotonic()
        box = _in_time(lambda: w.collect(1), 30)
        assert isinstance(box.get("error"), UnisonError), box
        assert f"the rollout worker (pid {w.pid}) died while generating (signal 9 (SIGKILL))" in str(box["error"])
        assert time.monotonic() - t0 < 5
    finally:
        w.close()


def test_7_a_live_but_stuck_worker_stops_the_collect_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(EngineWorker, "MIN_TIMEOUT_S", 1.0, raising=False)
    w = _worker(behaviour="hang_after", n=1)  # the first batch comes back, the second never
    try:
        w.submit(1, [[1, 2]], SamplingParams(n=2, max_tokens=2), 0)
        assert len(w.collect(1)[0]) == 2
        w.submit(2, [[1, 2]], SamplingParams(n=2, max_tokens=2), 0)
        t0 = time.monotonic()
        box = _in_time(lambda: w.collect(2), 30)
        msg = str(box.get("error"))
        assert isinstance(box.get("error"), UnisonError) and "\n" not in msg, box
        assert msg.startswith(f"the rollout worker (pid {w.pid}) is alive but returned no batch for ")
        assert "10 × the slowest batch so far" in msg and "rollout.worker_timeout_s" in msg and "--resume" in msg
        assert time.monotonic() - t0 < w._deadline() + 4  # its own limit (≥ 1 s: 10 × the first batch's time)
        assert w.proc.is_alive()  # stuck, not dead
        # item 9: where the kernel cannot kill it with its parent (not Linux), the end of its command pipe
        # ends it — at once, even mid-generation, and cleanly (item 13: close() does the same)
        t0 = time.monotonic()
        w._cmds.close()
        w.proc.join(timeout=3)
        assert not w.proc.is_alive() and w.proc.exitcode == 0 and time.monotonic() - t0 < 3
    finally:
        w.close()
    assert load_config(None, ["rollout.worker_timeout_s=120"]).rollout.worker_timeout_s == 120.0


def test_14_a_slot_rewritten_while_the_worker_loads_it_is_not_trained_on_as_torn_weights(tmp_path):
    # stale_policy drop (version None: the newest), K = 1: two slots. The worker starts loading version 0
    # (zeros) slowly; meanwhile versions 1 (ones) and 2 (twos, slot 0 again) are published.
    marker = tmp_path / "loading"
    w = _worker(behaviour="slow_load", seconds=1.0, marker=str(marker))
    try:
        w.submit(1, [[1, 2]], SamplingParams(n=1, max_tokens=2), None)
        deadline = time.monotonic() + 60
        while not marker.exists():  # the worker has read version 0's first tensor: the slot is rewritten under it
            assert time.monotonic() < deadline, "the worker never loaded"
            time.sleep(0.02)
        for v in (1, 2):
            w.publish(v, [("a", torch.full((4,), float(v))), ("b", torch.full((4,), float(v)))])
        comps, version, *_ = w.collect(1)
        a, b = comps[0].token_ids[:2]  # what the engine holds: tensor a, read first; tensor b, read 1 s later
        assert a == b == version, (a, b, version)  # never a of version 0 with b of version 2, labelled 0
    finally:
        w.close()


def test_13_a_run_generates_no_batch_past_its_last_step_and_its_worker_exits_cleanly(tmp_path, rewards):
    cfg = load_config(None, BASE + ["train.steps=3", "rollout.max_staleness=2"])
    t = Trainer(cfg, tmp_path / "r", log=lambda m: None)
    submitted = []
    submit = t.source.backend.submit
    t.source.backend.submit = lambda job, prompts, params, version: (submitted.append(job), submit(job, prompts,
                                                                                                    params, version))
    for _ in range(3):
        t.train_step()
    state = t.source.state_dict()  # what the final checkpoint records
    t.source.close()  # how fit() ends
    assert len(submitted) == 3  # one batch per step: none for steps 4 and 5 (K = 2 ahead of step 3)
    assert [j["step"] for j in state["inflight"]] == [3, 4]  # drawn (a longer run draws the same), not generated
    proc = t.source.backend.worker.proc
    assert not proc.is_alive() and proc.exitcode == 0  # stopped, not SIGKILLed mid-generation


ORPHAN = textwrap.dedent("""
    import sys, time, torch
    import fake_worker
    from unison.rollout import SamplingParams
    from unison.rollout.worker import EngineWorker
    w = EngineWorker(fake_worker.spec(behaviour="sleep", seconds=120), [("a", (4,)), ("b", (4,))], slots=2)
    w.publish(0, [("a", torch.zeros(4)), ("b", torch.zeros(4))])
    w.submit(1, [[1, 2]], SamplingParams(n=1, max_tokens=2), 0)
    print(w.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow  # a trainer process of its own: startup alone is seconds
def test_9_an_orphaned_worker_dies_with_its_trainer(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(ORPHAN)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=_env())
    pid = None
    try:
        pid = int(proc.stdout.readline())
        time.sleep(1.5)  # the worker is 1.5 s into a 120 s generation: no parent check runs before it ends
        assert _alive(pid)
        proc.kill()  # SIGKILL: no cleanup runs in the trainer
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the worker outlived its trainer"
    finally:
        proc.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


MOE = textwrap.dedent("""
    import resource, sys, threading, torch
    from unison.learner import Learner
    from unison.rollout import SamplingParams
    from unison.rollout.worker import EngineWorker, WorkerSpec
    from unison.zoo import build
    model = build("qwen3_moe", sys.argv[1])
    shapes = [(n, tuple(t.shape)) for n, t in Learner(model).export_weights(None)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the worker inherits it
    from unison.sides import Side

    w = EngineWorker(WorkerSpec(str(model), Side(), "cpu", 1, 0, 1), shapes, slots=2)
    w.publish(0, Learner(model).export_weights(None))
    w.submit(1, [[1, 5, 6, 7]] * 4, SamplingParams(n=80, max_tokens=3, seed=1), 0)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=w.collect(1)), daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():
        print("HANG", flush=True)
    else:
        comps = box["r"][0]
        print(len(comps), sum(c.routing is not None and c.routing.shape[0] > 0 for c in comps), flush=True)
    import os
    os._exit(0)
""")


@pytest.mark.slow  # a trainer process of its own: startup alone is seconds
def test_5_moe_routing_of_hundreds_of_rows_comes_back_under_a_low_file_limit(tmp_path):
    script = tmp_path / "moe.py"
    script.write_text(MOE)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "moe")], capture_output=True, text=True,
                       timeout=180, env=_env())
    assert r.returncode == 0 and r.stdout.split() == ["320", "320"], (r.stdout, r.stderr[-3000:])


def test_6_shared_memory_is_checked_for_the_whole_node_and_a_missing_dev_shm_is_refused(monkeypatch):
    from unison.rollout.backends import check_shared_memory

    shapes = [("w", (1024, 1024))]  # 4 MiB of fp32: 8 MiB for 2 slots
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 0, 0, 12 * 2**20 // 4096, 0, 0,
                                                                    0, 0, 255)))  # 12 MiB free
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_shared_memory(shapes, 2)  # one rank: 8 MiB fit
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the node share it: 16 MiB do not
    with pytest.raises(UnisonError, match=r"keeps 2 ranks on this node × 2 fp32 copies .*0\.02 GiB.*0\.01 GiB free"):
        check_shared_memory(shapes, 2)

    def missing(p):
        raise FileNotFoundError(2, "No such file or directory", p)

    monkeypatch.setattr(os, "statvfs", missing)
    with pytest.raises(UnisonError, match="this machine has no /dev/shm"):
        check_shared_memory(shapes, 2)


# ------------------------------------------------------------------ the run: signals, leaks, resume
@pytest.mark.slow  # a trainer process of its own: startup alone is seconds
def test_4_sigterm_to_the_process_group_saves_a_checkpoint_and_exits_143(tmp_path, rewards):
    # GNU timeout, systemd and schedulers signal the whole group: the worker gets SIGTERM too
    # long responses of few prompts: generating a batch takes longer than training one, so the trainer is
    # waiting for the worker's next batch when the signal lands (where a worker that dies of it is noticed)
    sets = [f"--set={s}" for s in BASE + ["train.steps=200", "rollout.max_staleness=1", "log.console=true",
                                          "rollout.max_new_tokens=320", "rollout.n=2", "train.prompts_per_step=1",
                                          "train.mini_batches=1", "rollout.worker_threads=1"]]
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("{}\n")
    proc = subprocess.Popen([sys.executable, "-m", "unison", "train", str(cfgfile), "--out", str(tmp_path / "run"),
                             *sets], stderr=subprocess.PIPE, text=True, env=_env(rewards), start_new_session=True)
    try:
        for line in proc.stderr:
            if line.startswith("[train] step 3/200"):  # step 4 starts by waiting for its batch (≈ 0.4 s)
                time.sleep(0.1)
                os.killpg(proc.pid, signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, rest
    stops = [x for x in rest.splitlines() if x.startswith("unison: ")]
    assert len(stops) == 1 and stops[0].startswith("unison: stopped by SIGTERM"), rest
    assert "checkpoint saved" in stops[0], rest
    assert "Traceback" not in rest and "worker" not in rest
    done = ckpt.complete(tmp_path / "run" / "checkpoints")
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert done and ckpt.verify(done[-1]) is None and done[-1].name == f"step_{steps[-1]:06d}"
    deadline = time.monotonic() + 10
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group(proc.pid), "a process of the run outlived it"


def test_11_a_trainer_that_fails_half_built_or_in_its_final_save_ends_its_rollout_source(tmp_path, rewards,
                                                                                        tiny_dir, monkeypatch):
    from unison.runlog import RunLog

    real_open = RunLog.open

    def unwritable(self, resumed_from):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(RunLog, "open", unwritable)  # fails after the worker started, as a damaged resume does
    with pytest.raises(OSError, match="Read-only"):
        Trainer(load_config(None, BASE + ["rollout.max_staleness=1", "train.steps=1"]), tmp_path / "r",
                log=lambda m: None)
    assert not _workers()  # the half-built Trainer ended its worker
    monkeypatch.setattr(RunLog, "open", real_open)
    with _stub(tiny_dir) as stub:  # the final save is inside the run: its failure ends the source (here a server's)
        t = Trainer(load_config(None, BASE + ["engine=vllm", "vllm.mode=server", f"vllm.url={stub.url}",
                                              "rollout.max_staleness=1", "train.steps=1"]), tmp_path / "s",
                    log=lambda m: None)
        threads = t.source.backend._threads

        def disk_full():
            raise OSError(28, "No space left on device")

        t.save_checkpoint = disk_full  # the final save (steps=1: the only one)
        with pytest.raises(OSError, match="No space left"):
            t.fit()
        for th in threads:
            th.join(timeout=5)
        assert not any(th.is_alive() for th in threads) and t.source.backend.engine.http.is_closed


def test_17_a_checkpoint_that_holds_code_is_refused_in_one_line_without_running_it(tmp_path, rewards):
    cfg = load_config(None, BASE + ["train.steps=1"])
    Trainer(cfg, tmp_path / "r", log=lambda m: None).fit()
    ck = ckpt.complete(tmp_path / "r" / "checkpoints")[-1]
    pwned = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {pwned}",)

    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    torch.save({**state, "step": Payload()}, ck / "trainer_state.pt")
    ckpt.write_manifest(ck)  # whoever wrote the directory wrote its manifest too
    with pytest.raises(UnisonError) as e:
        Trainer(load_config(None, BASE + ["train.steps=2"]), tmp_path / "r", resume=True, log=lambda m: None)
    msg = str(e.value)
    assert "\n" not in msg and "trainer_state.pt holds more than data (a pickled posix.system)" in msg
    assert "will not run code" in msg
    assert not pwned.exists()


def test_17_checkpoints_load_as_data_only_and_old_rng_files_still_resume_exactly(tmp_path, rewards):
    import numpy as np

    sets = BASE + ["checkpoint.every=1", "train.schedule=surge_decay", "precision=fp16"]
    Trainer(load_config(None, sets + ["train.steps=3"]), tmp_path / "full", log=lambda m: None).fit()
    Trainer(load_config(None, sets + ["train.steps=2"]), tmp_path / "part", log=lambda m: None).fit()
    ck = ckpt.complete(tmp_path / "part" / "checkpoints")[-1]
    torch.load(ck / "trainer_state.pt", weights_only=True)  # plain data (scaler, surge detector, sampler...)
    rng = torch.load(ck / "rng_rank0.pt", weights_only=True)
    name, keys, *rest = rng["numpy"]
    torch.save({**rng, "numpy": (name, keys.numpy().astype(np.uint32), *rest)}, ck / "rng_rank0.pt")  # as before
    ckpt.write_manifest(ck)
    Trainer(load_config(None, sets + ["train.steps=3"]), tmp_path / "part", resume=True, log=lambda m: None).fit()

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))} for r in rows]

    assert comparable(read_metrics(tmp_path / "part" / "metrics.jsonl")) == \
        comparable(read_metrics(tmp_path / "full" / "metrics.jsonl"))


KILLER = textwrap.dedent("""
    import os, signal, sys
    from unison.config import load_config
    from unison.trainer import Trainer
    point, out, k = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = load_config(None, {base!r} + ["train.steps=5", "checkpoint.every=2", "rollout.max_staleness=" + k])
    t = Trainer(cfg, out, resume=os.path.exists(out), log=lambda m: None)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if point == "collect":             # step 3, waiting for its batch (generated ahead, in the worker)
        collect = t.source.backend.collect
        t.source.backend.collect = lambda job: die() if t.step == 2 else collect(job)
    elif point == "update":            # inside the optimizer update of step 5 (after the step-4 checkpoint)
        train = t.learner.train
        t.learner.train = lambda *a, **kw: die() if t.step == 4 else train(*a, **kw)
    elif point == "checkpoint":        # the step-4 checkpoint: its model written, the older versions not yet
        import unison.checkpoint as C
        save = C.save_model
        C.save_model = lambda l, p, tok: (save(l, p, tok), die()) if t.step == 4 else save(l, p, tok)
    t.fit()
""")


@pytest.mark.parametrize("cases", [
    pytest.param([(2, "none"), (2, "update")], id="K2-update"),
    pytest.param([(k, p) for k in (1, 2) for p in ("none", "collect", "update", "checkpoint")], id="K1,2-every-point",
                 marks=pytest.mark.faults)])
def test_3_sigkill_with_batches_in_flight_then_resume_equals_the_uninterrupted_run(tmp_path, rewards, cases):
    # K = 1 and 2 on the native worker, killed at three points (two resume from step 2's checkpoint, one from
    # step 4's): the checkpoint keeps the older versions the jobs in flight are generated with, so the resumed
    # run's every metric and its final weights are the uninterrupted run's, bit for bit. The default suite kills
    # at one point (K = 2, mid-update); `make test-faults` (CI) runs every point at both K.
    from safetensors.torch import load_file

    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(base=BASE))

    def run(point, out, k):
        return subprocess.run([sys.executable, str(script), point, str(out), str(k)], capture_output=True,
                              text=True, timeout=300, env=_env(rewards))

    def kill_then_resume(case):  # each case in a directory of its own, two at a time (a process per core)
        k, point = case
        out = tmp_path / f"k{k}-{point}"
        first = run(point, out, k)
        again = run("none", out, k) if point != "none" and first.returncode == -9 else None
        return k, point, out, first, again

    def comparable(out):
        return [{key: v for key, v in r.items() if not key.startswith(("time/", "throughput/", "memory/"))}
                for r in read_metrics(out / "metrics.jsonl")]

    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(kill_then_resume, cases))
    ref = {k: out for k, point, out, first, _ in done if point == "none"}
    for k, point, out, first, again in done:
        if point == "none":
            assert first.returncode == 0, first.stderr[-2000:]
            assert [r["staleness/max"] for r in read_metrics(out / "metrics.jsonl")] == \
                [min(s, k) for s in range(5)]  # every batch as stale as K allows: there is something in flight
            continue
        assert first.returncode == -9, (k, point, first.stderr[-2000:])
        assert again.returncode == 0, (k, point, again.stderr[-2000:])
        assert comparable(out) == comparable(ref[k]), (k, point)
        a, b = (load_file(o / "checkpoints/step_000005/model/model.safetensors") for o in (out, ref[k]))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), (k, point)
        assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())


# ------------------------------------------------------------------ a vLLM server (the HTTP stub)
def _stub(model_dir, **kw):
    from unison.models import load_tokenizer
    from unison.rollout.vllm_server import PROBE_TEXT
    from vllm_stub import StubServer

    tok = load_tokenizer(model_dir)
    return StubServer(str(model_dir), list(tok(PROBE_TEXT)["input_ids"]), len(tok), **kw)


def _server(url, tmp_path):
    from unison.rollout.vllm_server import VLLMServerEngine

    return VLLMServerEngine(_tiny(), url=url, sync_dir=str(tmp_path / "sync"), retries=0)


def _tiny():
    from unison.models import builtin_model_dir

    return builtin_model_dir("tiny")


@pytest.fixture(scope="module")
def learner():
    from unison.learner import Learner

    return Learner(_tiny())


@pytest.mark.parametrize("k", [0, 1])
def test_1_a_fresh_server_run_syncs_version_0_before_its_first_batch(tmp_path, rewards, tiny_dir, k):
    with _stub(tiny_dir) as stub:
        cfg = load_config(None, BASE + ["engine=vllm", "vllm.mode=server", f"vllm.url={stub.url}", "train.steps=1",
                                        f"rollout.max_staleness={k}"])
        Trainer(cfg, tmp_path / "r", log=lambda m: None).fit()
    assert stub.reload_paths[0].endswith("/v000000")  # the learner's initial weights
    assert stub.gen_log and all(start >= 1 for _, start, _ in stub.gen_log)  # no batch from what the server held


def _release_on(stub, name: str, hold: threading.Event) -> None:
    """Set ``hold`` once the stub has done ``name`` (from a thread: the caller may be blocked on what it holds)."""
    def release():
        assert stub.event(name).wait(120), f"the server never did {name}"
        hold.set()

    threading.Thread(target=release, daemon=True).start()


def test_2_a_reload_that_fails_in_flight_returns_none_of_the_requests_it_spanned(tmp_path, learner):
    from unison.rollout.backends import ServerBackend

    # ordered on what the server did, not on delays: the request is held in generation until the engine,
    # its reload failed, has aborted what was in flight
    hold = threading.Event()
    with _stub(_tiny(), fail_reloads={2}, hold_completions=hold) as stub:
        eng = _server(stub.url, tmp_path)
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        box: dict = {}

        def generate():
            try:
                box["value"] = eng.generate([[1, 5, 6]], SamplingParams(n=2, max_tokens=4))
            except UnisonError as e:
                box["error"] = e

        gen = threading.Thread(target=generate)
        gen.start()
        assert stub.event("generating").wait(60)  # the request is being generated
        _release_on(stub, "pause:abort", hold)
        with pytest.raises(UnisonError, match="failed the weight reload"):
            eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), in_flight=True, version=1)
        gen.join(60)
        assert isinstance(box.get("error"), UnisonError), box  # not samples of half-loaded layers
        assert "failed the weight reload" in str(box["error"])
        assert stub.pause_modes == ["wait", "abort", "abort"] and not stub.paused
        with pytest.raises(UnisonError, match="failed the weight reload"):  # and nothing after it either
            eng.generate([[1, 5, 6]], SamplingParams(n=1, max_tokens=2))
        eng.close()
    # the backend reports that failure, not what followed from it (the aborted requests)
    hold = threading.Event()
    with _stub(_tiny(), fail_reloads={2}, hold_completions=hold) as stub:
        eng = _server(stub.url, tmp_path)
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        cfg = load_config(None, BASE + ["rollout.stale_policy=drop", "rollout.max_staleness=1"])
        b = ServerBackend(eng, cfg.rollout)
        b.submit(1, [[1, 5, 6]], SamplingParams(n=2, max_tokens=4), None)
        assert stub.event("generating").wait(60)
        _release_on(stub, "pause:abort", hold)
        b.publish(weights_of(learner), 1)
        with pytest.raises(UnisonError, match="failed the weight reload"):
            b.collect(1)
        b.close()


def test_8_closing_during_a_slow_reload_leaves_the_server_resumed(tmp_path, learner):
    from unison.rollout.backends import ServerBackend

    hold = threading.Event()
    with _stub(_tiny(), hold_reloads=hold) as stub:
        eng = _server(stub.url, tmp_path)
        b = ServerBackend(eng, load_config(None, BASE + ["rollout.stale_policy=drop", "rollout.max_staleness=1"]).rollout)
        b.publish(weights_of(learner), 1)
        assert stub.event("reload").wait(60)  # the reload is under way, held until released
        assert stub.paused
        threading.Timer(0.5, hold.set).start()  # it ends while close() waits (or before: the outcome is the same)
        b.close()  # the run ends (an error elsewhere, the last step)
        assert not stub.paused, "the server was left paused: the next run's requests would wait out their time-outs"


def test_10_server_drop_keeps_only_the_newest_pending_sync(tmp_path, learner):
    from unison.rollout.backends import ServerBackend

    hold = threading.Event()
    with _stub(_tiny(), hold_reloads=hold) as stub:
        eng = _server(stub.url, tmp_path)
        b = ServerBackend(eng, load_config(None, BASE + ["rollout.stale_policy=drop", "rollout.max_staleness=1"]).rollout)
        b.publish(weights_of(learner), 1)
        assert stub.event("reload").wait(60)  # version 1's reload is under way (held): 19 more steps end meanwhile
        pending = []
        for v in range(2, 21):
            b.publish(weights_of(learner), v)
            pending.append(len(b._sync_q))
        hold.set()
        deadline = time.monotonic() + 60
        while (b._sync_q or not stub.reload_paths or not stub.reload_paths[-1].endswith("v000020")) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        b.close()
    assert max(pending) <= 1  # one host copy waiting at most, not one per step
    assert stub.reload_paths[-1].endswith("/v000020") and eng.version == 20  # the server caught up
    assert [p[-7:] for p in stub.reload_paths] == ["v000001", "v000020"]  # superseded syncs were never applied


def test_12_disk_sync_clears_what_interrupted_syncs_left(tmp_path, learner):
    sync = tmp_path / "sync"
    for d in (".tmp-v000007", "v000003"):  # a sync killed mid-write, an older run's last version
        (sync / d).mkdir(parents=True)
        (sync / d / "model.safetensors").write_bytes(b"x" * 1000)
    with _stub(_tiny()) as stub:
        eng = _server(stub.url, tmp_path)
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        eng.close()
    assert sorted(p.name for p in sync.iterdir()) == ["v000000"]


def test_15_requests_sent_while_a_pause_is_in_flight_take_the_new_version(tmp_path, learner):
    # the server holds a request that arrives while it is paused: it runs wholly under the new weights
    hold = threading.Event()  # the reload waits for the request to have arrived, paused
    with _stub(_tiny(), pause_delay=0.2, hold_reloads=hold) as stub:
        eng = _server(stub.url, tmp_path)
        hold.set()
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        hold.clear()
        stub.event("completion").clear()
        prepared = eng.prepare_sync(weight_update(eng, learner))
        sync = threading.Thread(target=lambda: eng.apply_sync(prepared, in_flight=True, version=1))
        sync.start()
        assert stub.event("pause:abort").wait(60)  # the pause is in flight (effective at once, answered later)
        _release_on(stub, "completion", hold)
        comps = eng.generate([[1, 5, 6]], SamplingParams(n=2, max_tokens=3, seed=3))
        sync.join()
        eng.close()
    (_, start, end), = [g for g in stub.gen_log]
    truth = start - 1  # reload r loads version r − 1 (reload 1: version 0)
    assert truth == 1 and end - 1 == 1
    assert all(c.versions == (1, 1) for c in comps), [c.versions for c in comps]  # not (0, 1): one too old


def _truth(c) -> list[int]:
    """The version that really sampled each token of a stub completion: its log-prob says the reloads done when
    its request began (−2 − 0.01 · reloads; reload r loads version r − 1)."""
    return [round((-2.0 - lp) / 0.01) - 1 for lp in c.logprobs]


def test_15_per_token_versions_on_a_response_that_spans_two_syncs(tmp_path, learner):
    # the request is held in generation; each in-flight sync aborts it (2 tokens sampled so far), and the engine
    # continues it from them under the new weights: 2 tokens of version 0, 2 of version 1, the rest of version 2
    hold = threading.Event()
    with _stub(_tiny(), hold_completions=hold) as stub:
        eng = _server(stub.url, tmp_path)
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        box: dict = {}
        gen = threading.Thread(target=lambda: box.setdefault("comps", eng.generate(
            [[1, 5, 6]], SamplingParams(n=2, max_tokens=8, seed=3))))
        gen.start()
        # each wait is on what the stub recorded, never on how soon a thread runs: the aborted requests' ends
        # (segments) as well as the new ones' starts — on a busy machine an aborted request's thread may notice
        # its abort after its sibling's continuation has already started
        for v, want, ended in ((1, 1, 0), (2, 2, 1)):  # sync 1 reaches the request (n = 2), sync 2 its two continuations
            _until(lambda: len(stub.segments) >= ended and _generating(stub) >= want,
                   f"{ended} request(s) ended and {want} being generated")
            eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), in_flight=True, version=v)
        _until(lambda: len(stub.segments) >= 3 and _generating(stub) >= 2,
               "both continuations of version 1 aborted and both of version 2 being generated")
        hold.set()
        gen.join(60)
        eng.close()
    comps = box["comps"]
    assert len(comps) == 2
    for c in comps:
        tv = c.versions_of_tokens()
        assert tv[:4] == [0, 0, 1, 1] and set(tv[4:]) == {2} and len(tv) >= 5, tv
        assert tv == _truth(c)  # each token labelled with the weights that sampled it, exactly
        assert c.versions == (0, 2) and c.finish_reason == "length" and len(c.token_ids) <= 8
    # the server saw: the request (n = 2) aborted, one continuation per sample (n = 1) aborted, then finished
    prompts = [seg[0] for seg in stub.segments]
    assert [seg[3] for seg in stub.segments] == [True, True, True, False, False]
    assert prompts[0] == [1, 5, 6] and all(p[:3] == [1, 5, 6] and len(p) == 5 for p in prompts[1:3])
    assert all(len(p) == 7 for p in prompts[3:])
    assert all(start == end for _, start, end, _ in stub.segments)  # no request ran across a reload
    from unison.batch import collate
    from unison.telemetry import batch_metrics

    batch = collate(comps, 0)
    batch.rewards = torch.zeros(2)
    m = batch_metrics(batch, 2)
    assert m["staleness/spanning_fraction"] == 1.0 and m["staleness/max"] == 2.0
    n = [len(c.token_ids) for c in comps]
    assert m["staleness/mean"] == pytest.approx(sum(2 * 2 + 2 * 1 for _ in comps) / sum(n))


def _until(done, what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


def _generating(stub) -> int:
    """Completions the stub is generating now (gone into generation, not yet answered)."""
    return stub.started - len(stub.segments)


def test_15_server_labels_are_never_newer_than_the_weights_that_sampled(tmp_path, learner):
    # in-flight syncs against a stream of requests: every token's label against the weights that really sampled it
    # each sync lands while a request is held in generation (released once the sync is done): every one of
    # the 5 is spanned by a response, whatever the machine's timing; others run between them
    hold = threading.Event()
    with _stub(_tiny(), hold_completions=hold) as stub:
        eng = _server(stub.url, tmp_path)
        eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), version=0)
        done, comps = threading.Event(), []

        def requests():
            i = 0
            while not done.is_set():
                i += 1
                comps.extend(eng.generate([[1, 5, 6]], SamplingParams(n=1, max_tokens=2, seed=i)))

        t = threading.Thread(target=requests)
        t.start()
        for v in range(1, 6):
            # a request that started after the hold was cleared is held until this sync aborts it (one that started
            # before may be finishing on a slow machine's schedule: waiting on it would let the sync miss)
            s0 = stub.started
            _until(lambda: stub.started > s0, "a completion being generated")
            eng.apply_sync(eng.prepare_sync(weight_update(eng, learner)), in_flight=True, version=v)
            n = len(comps)
            hold.set()  # the continuation ends under version v
            deadline = time.monotonic() + 60
            while len(comps) == n and time.monotonic() < deadline:
                time.sleep(0.01)
            hold.clear()
        done.set()
        hold.set()
        t.join()
        eng.close()
    exact = older = 0
    for c in comps:
        for label, truth in zip(c.versions_of_tokens(), _truth(c)):
            assert label <= truth  # the bound holds: never newer
            exact += label == truth
            older += label < truth
    spans = sum(c.versions[0] < c.versions[1] for c in comps)
    assert len(comps) >= 5 and spans >= 5, (len(comps), spans)  # every sync reached a response mid-way
    from unison.batch import collate
    from unison.telemetry import batch_metrics

    batch = collate(comps, 0)
    batch.rewards = torch.zeros(batch.size)
    assert batch_metrics(batch, 6)["staleness/spanning_fraction"] == pytest.approx(spans / len(comps))  # the batch says so
    print(f"{older} of {exact + older} tokens labelled older than the weights that sampled them")


# ------------------------------------------------------------------ the docs
def test_16_the_docs_claim_determinism_and_exact_resume_only_where_they_hold():
    import re

    def sentences(path):
        text = " ".join((ROOT / path).read_text(encoding="utf-8").split())
        return re.split(r"(?<=[.;])\s", text)

    def claims(path):
        timing = [x for x in sentences(path) if "whatever the machine's timing" in x]
        resumed = [x for x in sentences(path) if re.search(r"resumed run reproduces the uninterrupted run", x)]
        return timing, resumed

    # the README's summary of async mode is docs/async.md's "In brief"; its `unison train --resume`, docs/cli.md
    for path in ("README.md", "docs/async.md", "docs/cli.md"):
        timing, resumed = claims(path)
        assert all("native" in x for x in timing), timing  # a vLLM server needs batch invariance
        # K ≥ 1 resumes exactly only where the engine keeps older versions: the native one
        assert all("native" in x or "max_staleness: 0" in x or "K = 0" in x for x in resumed), resumed
    assert claims("docs/async.md")[0] and any("VLLM_BATCH_INVARIANT" in x for x in sentences("docs/async.md"))
    assert claims("docs/cli.md")[1] and claims("docs/async.md")[1]
    assert any("vLLM server" in x and "fresher" in x for x in sentences("docs/async.md"))
