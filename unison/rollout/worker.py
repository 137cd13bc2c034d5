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
after step ``j``'s update, by which time batch ``j`` has been generated and scored. The worker
checks the slot's version again after loading it (a seqlock), so a slot rewritten mid-load (the
newest weights under ``stale_policy: drop``, or a weakly ordered CPU) is never trained on as
what it is not.

Commands go through a pipe in order: ``("gen", job, prompts, params, version)`` makes the worker
wait until the ring holds ``version`` (``None``: the newest it holds), load it if it is not loaded
yet, and generate. Results come back through another pipe with the version used, the seconds it
generated and the seconds it sat idle. Both pipes carry length-prefixed frames of plain pickles
(tensors by value, no file descriptors travel: a batch of MoE routing tensors is one message),
and each end of a pipe is held by exactly one process, so a process that dies mid-frame is an
end-of-file on the other side, never a read that waits for ever.

The worker ignores SIGINT and SIGTERM (a signal to the whole process group is the trainer's to
handle: it finishes its step, saves and stops the worker) and dies with the trainer: the kernel
kills it when its parent exits (Linux ``PR_SET_PDEATHSIG``), and its command pipe's end-of-file
ends it at once anywhere (as does the parent check between jobs).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from unison import gemm, runtime
from unison.errors import UnisonError
from unison.rollout import generate
from unison.rollout.native import NativeEngine
from unison.sides import Side


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
    #: the engine's numerics (dtype, weight format, compiled layers), as the trainer decided
    side: Side
    device: str
    threads: int
    dp_rank: int
    dp_size: int
    #: the run's fp32 matmul library (unison/gemm.py), decided by the trainer
    gemm: str = "blas"


# ------------------------------------------------------------------ frames on a pipe
_LEN = struct.Struct("!Q")


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_frame(fd: int, data: bytes) -> None:
    _write_all(fd, _LEN.pack(len(data)))
    _write_all(fd, data)


def _read_exactly(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _send(fd: int, obj) -> None:
    _write_frame(fd, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class _Inbox:
    """The parent's end of the results pipe: whole frames, read without ever blocking on a half-written one."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, bytearray()

    def _frame(self):
        if len(self.buf) < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self.buf)
        if len(self.buf) < _LEN.size + n:
            return None
        data = bytes(self.buf[_LEN.size:_LEN.size + n])
        del self.buf[:_LEN.size + n]
        return pickle.loads(data)

    def get(self, timeout: float):
        """The next message, or None when none completed within ``timeout`` seconds; EOFError when the
        worker's end is closed (it died, mid-frame or not)."""
        end = time.monotonic() + timeout
        while (msg := self._frame()) is None:
            left = end - time.monotonic()
            if left <= 0 or not wait([self.fd], left):  # poll(2): no FD_SETSIZE limit
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk
        return msg


class _Outbox:
    """The worker's end of the results pipe, written by a thread of its own: generation goes on while
    the parent is busy (a pipe holds 64 KiB; a result can be megabytes)."""

    def __init__(self, fd: int):
        self.fd, self.q = fd, queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="unison-worker-send")
        self.thread.start()

    def put(self, msg) -> None:
        self.q.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def flush(self) -> None:
        self.q.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (data := self.q.get()) is not None:
            try:
                _write_frame(self.fd, data)
            except OSError:  # the parent closed its end or died: nobody is waiting
                os._exit(0)


# ------------------------------------------------------------------ the worker process
def _serve_commands(fd: int, inbox: queue.Queue) -> None:  # pragma: no cover - subprocess
    """Read commands as they come (the parent never blocks on a full pipe); ``stop``, or the end of the
    pipe (the parent closed it or died, even mid-command), ends the process at once."""
    while True:
        try:
            n = _LEN.unpack(_read_exactly(fd, _LEN.size))[0]
            cmd = pickle.loads(_read_exactly(fd, n))
        except (EOFError, OSError):
            os._exit(0)
        if cmd[0] == "stop":
            os._exit(0)
        inbox.put(cmd)


def _load(engine, ring: WeightRing, version: int | None, loaded: int) -> int:  # pragma: no cover - subprocess
    """Load ``version`` (None: the newest the ring holds) unless it is loaded already; the version the
    engine now holds. The slot's version is read again after the copy: a slot rewritten while it was
    read is loaded again (the newest) or reported (a version that must be exact is gone)."""
    while True:
        v = ring.newest() if version is None else version
        if v == loaded:
            return v
        weights = ring.read(v)
        if weights is not None:
            engine.load_weights(weights.items())
            if ring.has(v):
                return v
        if version is not None:
            raise RuntimeError(f"weight version {v} was overwritten in the ring before the worker had loaded it")
        loaded = -1  # the engine holds a mix of two versions: load the newest again


def _worker_main(spec: WorkerSpec, ring: WeightRing, cmds, results, parent: int) -> None:  # pragma: no cover - subprocess
    """The worker process: build the engine, then serve commands until told to stop."""
    runtime.die_with_parent(parent)  # elsewhere than Linux: the command pipe's end and the parent check end it
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C and SIGTERM to the process group are the
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # trainer's to handle: it saves, then stops us
    torch.set_num_threads(spec.threads)

    runtime.keep_freed_memory()
    gemm.use(spec.gemm)
    out = _Outbox(results.fileno())
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_serve_commands, args=(cmds.fileno(), inbox), daemon=True,
                     name="unison-worker-commands").start()
    try:
        engine = NativeEngine(spec.model_dir, spec.side, device=spec.device)
        engine.dp_rank, engine.dp_size = spec.dp_rank, spec.dp_size
        out.put(("ready", os.getpid(), engine.pad_id, engine.eos_ids, engine.kernels.compile_s))
    except BaseException as e:  # noqa: BLE001 - reported to the parent in one line
        out.put(("error", None, _one_line(e)))
        out.flush()
        return
    loaded, idle = -1, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            _, job, prompts, params, version = inbox.get(timeout=1.0)
        except queue.Empty:
            idle += time.perf_counter() - t0
            if os.getppid() != parent:  # the trainer died: do not linger
                return
            continue
        try:
            while version is not None and not ring.has(version):  # wait for the weights (stale_policy wait)
                if os.getppid() != parent:
                    return
                time.sleep(0.001)
            idle += time.perf_counter() - t0
            loaded = _load(engine, ring, version, loaded)
            t1 = time.perf_counter()
            comps = generate(engine, prompts, params)  # multi-turn episodes run here, turn by turn
            for c in comps:
                c.set_version(loaded)
            out.put(("done", job, comps, loaded, time.perf_counter() - t1, idle))
            idle = 0.0
        except BaseException as e:  # noqa: BLE001
            out.put(("error", job, _one_line(e)))
            out.flush()
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
    """The parent's handle on a worker process: publish weights, submit jobs, collect results.

    The process dies with the thread that created it (``PR_SET_PDEATHSIG``): create it on the thread
    that runs the training."""

    #: seconds between liveness checks while waiting (a dead worker is reported within this)
    POLL_S = 1.0
    #: without ``timeout_s``: a batch may take 10 × the slowest one so far, at least MIN_TIMEOUT_S
    #: (the first one FIRST_TIMEOUT_S), before the worker counts as stuck
    TIMEOUT_FACTOR, MIN_TIMEOUT_S, FIRST_TIMEOUT_S = 10.0, 300.0, 3600.0

    def __init__(self, spec: WorkerSpec, named_shapes, slots: int, startup_timeout_s: float = 600.0,
                 timeout_s: float | None = None):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.ring = WeightRing(named_shapes, slots)
        self.timeout_s, self._slowest = timeout_s, 0.0
        cmd_r, self._cmds = ctx.Pipe(duplex=False)
        self._results, res_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_worker_main, name="unison-rollout-worker",
                                args=(spec, self.ring, cmd_r, res_w, os.getpid()), daemon=True)
        with _main_hidden():
            self.proc.start()
        cmd_r.close()  # the child holds the other ends alone: its death is an end-of-file here
        res_w.close()
        self._inbox = _Inbox(self._results.fileno())
        self._done: dict[int, tuple] = {}
        self._closed = False
        atexit.register(self.close)  # before multiprocessing's own exit hook, which would SIGTERM it (ignored)
        try:
            msg = self._get(startup_timeout_s, "starting")
        except BaseException:
            self.close()
            raise
        _, self.pid, self.pad_id, self.eos_ids, self.compile_s = msg

    # --------------------------------------------------------------- protocol
    def publish(self, version: int, named_tensors) -> None:
        self.ring.write(version, named_tensors)

    def submit(self, job: int, prompts, params, version: int | None) -> None:
        try:
            _send(self._cmds.fileno(), ("gen", job, prompts, params, version))
        except OSError:  # its end of the pipe is closed: it died
            self.proc.join(timeout=5)
            raise UnisonError(self._death("generating")) from None

    def collect(self, job: int):
        """``(completions, version, gen_s, idle_s)`` of ``job`` (waiting for it)."""
        while job not in self._done:
            msg = self._get(self._deadline(), "generating")
            self._done[msg[1]] = msg[2:]
            self._slowest = max(self._slowest, msg[4])
        return self._done.pop(job)

    def _deadline(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        if not self._slowest:
            return self.FIRST_TIMEOUT_S
        return max(self.MIN_TIMEOUT_S, self.TIMEOUT_FACTOR * self._slowest)

    def _get(self, timeout_s: float, doing: str):
        start = time.monotonic()
        while True:
            try:
                msg = self._inbox.get(self.POLL_S)
            except EOFError:
                self.proc.join(timeout=5)
                raise UnisonError(self._death(doing)) from None
            if msg is None:
                if not self.proc.is_alive():
                    raise UnisonError(self._death(doing))
                waited = time.monotonic() - start
                if waited > timeout_s:
                    raise UnisonError(self._stuck(doing, waited))
                continue
            if msg[0] == "error":
                raise UnisonError(f"the rollout worker failed while {doing}: {msg[2]}")
            return msg

    def _stuck(self, doing: str, waited: float) -> str:
        if doing == "starting":
            return (f"the rollout worker did not start within {waited:.0f} s: check memory and the model "
                    f"directory")
        rule = ("rollout.worker_timeout_s" if self.timeout_s is not None else
                f"10 × the slowest batch so far ({self._slowest:.1f} s), at least {self.MIN_TIMEOUT_S:.0f} s"
                if self._slowest else "the first batch's limit")
        return (f"the rollout worker (pid {self.proc.pid}) is alive but returned no batch for {waited:.0f} s "
                f"({rule}): it is stuck; the run's last checkpoint is intact — continue with --resume, and set "
                f"rollout.worker_timeout_s if a batch can really take this long")

    def _death(self, doing: str) -> str:
        code = self.proc.exitcode
        how = f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else f"exit code {code}"
        return (f"the rollout worker (pid {self.proc.pid}) died while {doing} ({how}): the run's last checkpoint is "
                f"intact; continue with --resume (a killed worker is often out of memory: lower "
                f"rollout.max_staleness or the batch)")

    def close(self) -> None:
        """Stop the worker (at once, even mid-batch: nothing it holds is needed) and free its pipes."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                _send(self._cmds.fileno(), ("stop",))
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        self._cmds.close()
        self._results.close()
