"""The engines behind :class:`~unison.rollout.source.AheadSource`: the native engine in a worker process of its own,
or a vLLM server with requests in flight (a generating thread and a sync thread). Each submits jobs, hands back
finished ones and takes weights of a version; the source decides when.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from unison import gemm
from unison.errors import UnisonError
from unison.rollout import generate
from unison.rollout.base import Weights
from unison.rollout.worker import EngineWorker, WorkerSpec
from unison.sides import Side
from unison.threads import budget, give


class NativeWorkerBackend:
    """The native engine in a worker process (:mod:`unison.rollout.worker`)."""

    name = "native"

    def __init__(self, model_dir, side: Side, device, rollout_cfg, dist, shapes):
        r = rollout_cfg
        cores = budget()  # this process's threads (the run's `threads`), split between the worker and the trainer
        threads = r.worker_threads or max(1, cores // 2)
        self.trainer_threads = max(1, cores - threads)
        spec = WorkerSpec(str(model_dir), side, device, threads, dist.rank, dist.world_size, gemm.current())
        # ``shapes``: what the policy's ``Weights.export(None)`` yields, in its order (what the ring holds)
        check_shared_memory(shapes, r.max_staleness + 1, dist)
        self.worker = EngineWorker(spec, shapes, slots=r.max_staleness + 1, timeout_s=r.worker_timeout_s)
        self.pad_id, self.eos_ids = self.worker.pad_id, self.worker.eos_ids
        self.dp_rank, self.dp_size = dist.rank, dist.world_size
        self.dtype = side.dtype
        self._eval = _EvalIds()
        give(self.trainer_threads)

    def publish(self, weights: Weights, version: int) -> dict[str, float]:
        self.worker.publish(version, weights.export(None))
        return {}

    def weights(self, version: int):
        return self.worker.ring.read(version)

    def publish_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """An older version's weights, kept by a checkpoint, into the ring (a resume)."""
        self.worker.publish(version, weights.items())

    def submit(self, job, prompts, params, version):
        self.worker.submit(job, prompts, params, version)

    def collect(self, job):
        return self.worker.collect(job)

    def generate(self, prompts, params):
        """Generate now with the newest weights, after the jobs in flight (evaluation)."""
        job = self._eval.next()
        self.worker.submit(job, prompts, params, None)
        return self.worker.collect(job)[0]

    def close(self) -> None:
        self.worker.close()


class ServerBackend:
    """A vLLM server (``vllm.mode: server``) with requests in flight while the trainer updates the policy.

    One thread generates the jobs in order. ``wait``: the weight sync of version v runs on that
    thread too, after the jobs submitted before it, so batch j sees exactly version max(0, j − K).
    ``drop``: syncs run on a thread of their own and reach the server in flight (pause aborting the
    requests being generated, reload, resume; the engine continues each under the new weights): a
    response can then span versions (``Completion.token_versions``). A sync
    not started yet is superseded by the next one (each holds a host copy of the model): the
    server takes the newest weights, never a backlog of old ones."""

    name = "vllm-server"

    def __init__(self, engine, rollout_cfg):
        self.engine = engine
        self.pad_id, self.eos_ids = engine.pad_id, engine.eos_ids
        self.dp_rank, self.dp_size = engine.dp_rank, engine.dp_size
        self.wait = rollout_cfg.stale_policy == "wait"
        self._eval = _EvalIds()
        self._done: dict[int, tuple] = {}
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._gen_q: deque = deque()
        self._sync_q: deque = deque()
        self._stop = False
        self._threads = [threading.Thread(target=self._run, args=(self._gen_q,), daemon=True, name="unison-gen")]
        if not self.wait:
            self._threads.append(threading.Thread(target=self._run, args=(self._sync_q,), daemon=True,
                                                  name="unison-sync"))
        for t in self._threads:
            t.start()
        self._sync_metrics: dict = {}

    def _run(self, q: deque) -> None:
        while True:
            with self._cv:
                while not q and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                cmd = q.popleft()
            try:
                cmd()
            except BaseException as e:  # noqa: BLE001 - surfaced on the trainer's thread
                with self._cv:
                    self._error = self._error or e  # the first failure is the cause; later ones follow from it
                    self._cv.notify_all()
                return

    def _put(self, q: deque, fn, supersede: bool = False) -> None:
        with self._cv:
            if supersede:
                q.clear()
            q.append(fn)
            self._cv.notify_all()

    def publish(self, weights: Weights, version: int) -> dict[str, float]:
        """Export now (the policy's weights of ``version``), apply in the background; the metrics of
        the newest sync that has been applied are returned (one step late)."""
        self._raise()
        prepared = self.engine.prepare_sync(weights.update_for(self.engine))

        def apply():
            m = self.engine.apply_sync(prepared, in_flight=not self.wait, version=version)
            with self._cv:
                self._sync_metrics = m

        self._put(self._gen_q if self.wait else self._sync_q, apply, supersede=not self.wait)
        with self._cv:
            return dict(self._sync_metrics)

    def generate(self, prompts, params):
        """Generate now, after the jobs in flight (evaluation)."""
        job = self._eval.next()
        self.submit(job, prompts, params, None)
        return self.collect(job)[0]

    def _raise(self) -> None:
        """A background thread that failed stops the run at the next call, whatever the call."""
        with self._cv:
            e = self._error
        if e is not None:
            raise e if isinstance(e, UnisonError) else UnisonError(
                f"the vLLM server's background thread failed: {type(e).__name__}: {e}")

    def weights(self, version: int):
        return None

    def submit(self, job, prompts, params, version):
        """``version`` is implied by the order: in wait mode the syncs run on this same thread, between the
        jobs submitted before and after them."""
        self._raise()

        def gen():
            t0 = time.perf_counter()
            comps = generate(self.engine, prompts, params)
            with self._cv:
                self._done[job] = (comps, None, time.perf_counter() - t0, 0.0)
                self._cv.notify_all()

        self._put(self._gen_q, gen)

    def collect(self, job):
        while True:
            self._raise()
            with self._cv:
                if job in self._done:
                    return self._done.pop(job)
                self._cv.wait(timeout=1.0)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self.engine.close()  # it waits for a reload in progress, which resumes the server


class _EvalIds:
    """Job ids for generation outside the training batches (evaluation): negative, never a training job's."""

    def __init__(self):
        self.n = 0

    def next(self) -> int:
        self.n -= 1
        return self.n


def check_shared_memory(named_shapes, slots: int, dist=None) -> None:
    """The weight ring needs ``slots`` fp32 copies of the model in /dev/shm, per rank — and the ranks of a
    node (``LOCAL_WORLD_SIZE``, set by torchrun) share one /dev/shm: refuse in one line, on every rank at
    once (``dist``: they all check before any allocates), when it cannot hold them (a container's default
    is 64 MB) or does not exist, instead of failing later with SIGBUS or a traceback."""
    problem = _shared_memory_problem(named_shapes, slots)
    if dist is not None:
        problem = next((p for p in dist.all_gather_object(problem) if p), None)
    if problem:
        raise UnisonError(problem)


def _shared_memory_problem(named_shapes, slots: int) -> str | None:
    import math
    import os
    import sys

    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    need = ranks * slots * 4 * sum(math.prod(s) for _, s in named_shapes)
    try:
        st = os.statvfs("/dev/shm")
    except FileNotFoundError:
        if sys.platform.startswith("linux"):  # torch's shared memory lives there: every allocation would fail
            return ("rollout.max_staleness keeps the weights in shared memory and this machine has no /dev/shm: "
                    "mount a tmpfs there (docker --shm-size), or set rollout.max_staleness=0")
        return None  # pragma: no cover - not Linux: shared memory lives elsewhere
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    free = st.f_bavail * st.f_frsize
    if need <= free:
        return None
    who = f"{ranks} ranks on this node × {slots}" if ranks > 1 else f"{slots}"
    return (f"rollout.max_staleness keeps {who} fp32 copies of the weights in shared memory "
            f"({need / 2**30:.2f} GiB) and /dev/shm has {free / 2**30:.2f} GiB free: lower "
            f"rollout.max_staleness, or give the container more (docker --shm-size)")


def _sync_server(engine, weights: Weights) -> None:
    """A vLLM server holds the weights it was started with, or a previous run's last ones: the policy's
    (version 0) reach it before the first batch is sampled. An in-process engine loads the model
    directory the trainer loads, and needs nothing."""
    if getattr(engine, "name", "") == "vllm-server":
        engine.apply_sync(engine.prepare_sync(weights.update_for(engine)), version=0)
