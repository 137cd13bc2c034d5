"""The native engine in a worker process of its own, fed weights through shared memory.

With ``rollout.max_staleness: K ≥ 1`` the rollout engine generates the next batches while the
learner trains (docs/async.md). The native engine then lives in a spawned process with its own
torch thread count (``rollout.worker_threads``); the learner keeps the others.

Weights travel through a :class:`WeightRing`: K + 1 slots of the model's fp32 weights in shared
memory, slot ``v mod (K+1)`` holding version ``v`` (the weights after ``v`` updates). The
learner copies its weights into the slot (one memcpy per tensor, no pickling); the worker reads
them as views and loads them into its engine (cast to its dtype, quantized when
``rollout.quantization`` says so). The ring also keeps the last K + 1 versions on the host, which
the trainer scores with to split the mismatch into numerics and staleness.

Why a slot is never overwritten while it is needed: batch ``j`` is generated with version
``j − K`` and trained at step ``j``; version ``j + 1`` (the next writer of that slot) exists only
after step ``j``'s update, by which time batch ``j`` has been generated and scored.

Commands go through a queue in order: ``("gen", job, prompts, params, version)`` makes the worker
wait until the ring holds ``version`` (``None``: the newest it holds), load it if it is not loaded
yet, and generate. Results come back through another queue with the version used, the seconds it
generated and the seconds it sat idle. A worker whose parent died exits within a second.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass

import torch

from unison.errors import UnisonError


class WeightRing:
    """``slots`` copies of a model's weights (fp32, one flat shared-memory buffer each) and the version
    each slot holds (−1: none, or being written)."""

    def __init__(self, named_shapes: list[tuple[str, tuple[int, ...]]], slots: int):
        self.layout, off = [], 0
        for name, shape in named_shapes:
            self.layout.append((name, off, tuple(shape)))
            off += math.prod(shape)
        self.numel = off
        self.bufs = [torch.zeros(off, dtype=torch.float32).share_memory_() for _ in range(slots)]
        self.versions = torch.full((slots,), -1, dtype=torch.int64).share_memory_()

    @property
    def slots(self) -> int:
        return len(self.bufs)

    def write(self, version: int, named_tensors) -> None:
        """Copy ``(name, tensor)`` pairs (every tensor of the layout, in any order) into version's slot."""
        slot = version % self.slots
        self.versions[slot] = -1
        buf, where = self.bufs[slot], {n: (o, s) for n, o, s in self.layout}
        seen = 0
        for name, t in named_tensors:
            off, shape = where[name]
            n = t.numel()
            buf[off:off + n].view(shape).copy_(t.detach())
            seen += 1
        if seen != len(self.layout):
            raise RuntimeError(f"weight ring: {seen} tensors written, {len(self.layout)} expected")
        self.versions[slot] = version

    def has(self, version: int) -> bool:
        return int(self.versions[version % self.slots]) == version

    def newest(self) -> int:
        return int(self.versions.max())

    def read(self, version: int) -> dict[str, torch.Tensor] | None:
        """Views of version's weights (no copy), or None when the ring no longer holds it."""
        if not self.has(version):
            return None
        buf = self.bufs[version % self.slots]
        return {n: buf[o:o + math.prod(s)].view(s) for n, o, s in self.layout}


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs to build its engine."""

    model_dir: str
    dtype: torch.dtype
    device: str
    quantization: str
    quant_group_size: int
    threads: int
    dp_rank: int
    dp_size: int


def _worker_main(spec: WorkerSpec, ring: WeightRing, cmds, results, parent: int) -> None:  # pragma: no cover - subprocess
    """The worker process: build the engine, then serve commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    torch.set_num_threads(spec.threads)
    try:
        from unison.rollout import generate
        from unison.rollout.native import NativeEngine

        engine = NativeEngine(spec.model_dir, dtype=spec.dtype, device=spec.device,
                              quantization=spec.quantization, quant_group_size=spec.quant_group_size)
        engine.dp_rank, engine.dp_size = spec.dp_rank, spec.dp_size
        results.put(("ready", os.getpid(), engine.pad_id, engine.eos_ids))
    except BaseException as e:  # noqa: BLE001 - reported to the parent in one line
        results.put(("error", None, _one_line(e)))
        return
    loaded, idle = -1, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            cmd = cmds.get(timeout=1.0)
        except queue.Empty:
            idle += time.perf_counter() - t0
            if os.getppid() != parent:  # the trainer died: do not linger
                return
            continue
        if cmd[0] == "stop":
            return
        _, job, prompts, params, version = cmd
        try:
            while version is not None and not ring.has(version):  # wait for the weights (stale_policy wait)
                if os.getppid() != parent:
                    return
                time.sleep(0.001)
            if version is None:
                version = ring.newest()
            idle += time.perf_counter() - t0
            if version != loaded:
                weights = ring.read(version)
                if weights is None:
                    raise RuntimeError(f"weight version {version} is no longer in the ring")
                engine.load_weights(weights.items())
                loaded = version
            t1 = time.perf_counter()
            comps = generate(engine, prompts, params)  # multi-turn episodes run here, turn by turn
            for c in comps:
                c.versions = (loaded, loaded)
            results.put(("done", job, comps, loaded, time.perf_counter() - t1, idle))
            idle = 0.0
        except BaseException as e:  # noqa: BLE001
            results.put(("error", job, _one_line(e)))
            return


@contextlib.contextmanager
def _main_hidden():
    """Start a spawned child without re-running the parent's ``__main__`` (a user's script without
    an ``if __name__ == "__main__"`` guard would otherwise run again in the child): the worker's
    code lives in this module, which the child imports by name."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if hasattr(main, k)}
    try:
        if main is not None:
            main.__spec__ = None
            if hasattr(main, "__file__"):
                del main.__file__
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _one_line(e: BaseException) -> str:
    msg = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {msg}" if not isinstance(e, UnisonError) else msg


class EngineWorker:
    """The parent's handle on a worker process: publish weights, submit jobs, collect results."""

    #: seconds between liveness checks while waiting (a dead worker is reported within this)
    POLL_S = 1.0

    def __init__(self, spec: WorkerSpec, named_shapes, slots: int, startup_timeout_s: float = 600.0):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.ring = WeightRing(named_shapes, slots)
        self.cmds, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_worker_main, name="unison-rollout-worker",
                                args=(spec, self.ring, self.cmds, self.results, os.getpid()), daemon=True)
        with _main_hidden():
            self.proc.start()
        self._done: dict[int, tuple] = {}
        msg = self._get(None, startup_timeout_s, "starting")
        _, self.pid, self.pad_id, self.eos_ids = msg

    # --------------------------------------------------------------- protocol
    def publish(self, version: int, named_tensors) -> None:
        self.ring.write(version, named_tensors)

    def submit(self, job: int, prompts, params, version: int | None) -> None:
        self.cmds.put(("gen", job, prompts, params, version))

    def collect(self, job: int):
        """``(completions, version, gen_s, idle_s)`` of ``job`` (waiting for it)."""
        while job not in self._done:
            msg = self._get(job, None, "generating")
            self._done[msg[1]] = msg[2:]
        return self._done.pop(job)

    def _get(self, job, timeout_s, doing: str):
        start = time.perf_counter()
        while True:
            try:
                msg = self.results.get(timeout=self.POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise UnisonError(self._death(doing)) from None
                if timeout_s is not None and time.perf_counter() - start > timeout_s:
                    raise UnisonError(f"the rollout worker did not start within {timeout_s:.0f} s: check memory "
                                      f"and the model directory") from None
                continue
            if msg[0] == "error":
                raise UnisonError(f"the rollout worker failed while {doing}: {msg[2]}")
            return msg

    def _death(self, doing: str) -> str:
        code = self.proc.exitcode
        how = f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit code {code}"
        return (f"the rollout worker (pid {self.proc.pid}) died while {doing} ({how}): the run's last checkpoint is "
                f"intact; continue with --resume (a killed worker is often out of memory: lower "
                f"rollout.max_staleness or the batch)")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.cmds.put(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        for q in (self.cmds, self.results):
            q.close()
            q.cancel_join_thread()
