"""Torch threads for every process unison runs: config ``threads: auto | N``, CLI ``--threads``.

Why it matters: torch splits each CPU op over its OpenMP threads and waits at the op's end for the
slowest. When the threads outnumber the cores that are actually free — another job on the machine,
a notebook beside the run, two runs on one box, a CI runner — one of them is descheduled at almost
every op, and with libgomp's default spin-waiting the waiting threads burn the time the others
need. A run on a 2-core machine beside one CPU-bound job took 15–40× longer with 2 threads than
with 1 (issue 32). Two mends, both here:

* **the thread count** (:func:`setup`): ``N`` is taken as given; ``auto`` (default) honours
  ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` and a ``torch.set_num_threads(n)`` the calling program
  made, and otherwise decides from what it measures at start: the cores this process may use
  (``sched_getaffinity``, capped by a cgroup CPU quota), divided among ``torchrun``'s local ranks;
  the model's size (below :data:`SMALL_MODEL` parameters every op is too small to gain from a second
  thread: 1); and the cores actually idle now (a :data:`SAMPLE_S` sample of ``/proc/stat`` over
  those cores: the time other processes take is not ours to split). The choice and its reason are
  printed at start (``threads 1 (auto: ...)``).
* **the wait policy** (:func:`prepare_environment`): the command line sets ``OMP_WAIT_POLICY=PASSIVE``
  before torch is imported (libgomp reads it once, when it is loaded), so a thread that waits sleeps
  instead of spinning — unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` themselves.
  Processes unison starts (the async worker, spawned) inherit it. A program that imports torch
  itself and then calls unison should export ``OMP_WAIT_POLICY=PASSIVE`` before starting Python.

The async worker (``rollout.max_staleness`` ≥ 1) and the learner split this process's budget
(``rollout.worker_threads``, default half of it); ``torchrun``'s ranks each get their share of the
node's cores (torchrun's own default ``OMP_NUM_THREADS=1`` for several local ranks is not taken as
the user's choice).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unison.config.values import parse_threads


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor elsewhere): what a per-machine measurement is
    kept under and what a benchmark reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


#: below this many parameters a model's ops are too small for a second thread to pay (the built-in
#: tiny model, 0.8M: 1 thread; SmolLM2-135M's matmuls scale with threads); benchmarks/threads.py.
#: The same class keeps torch's plain paths elsewhere (unison/runtime.py: :func:`small_model`)
SMALL_MODEL = 10_000_000


#: seconds of /proc/stat sampled to see how many cores are idle
SAMPLE_S = 0.25
#: environment variables through which a user sets the thread count of torch's OpenMP pool
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: the count unison itself last gave torch (not a user's choice when read back), and this process's
#: budget (what :func:`setup` decided; the async worker and the learner split it)
_applied: int | None = None
_budget: int | None = None
#: torch was not imported when the command line started: no user code can have set its threads
_torch_untouched = False


def prepare_environment() -> None:
    """Before torch is imported (the command line's first act): waiting OpenMP threads sleep rather
    than spin, unless the user chose a wait policy."""
    global _torch_untouched
    _torch_untouched = "torch" not in sys.modules
    if not any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


@dataclass(frozen=True)
class Threads:
    """The thread count of this process and why."""

    n: int
    reason: str

    def __str__(self) -> str:
        return f"threads {self.n} ({self.reason})"


def usable_cores() -> tuple[int, list[int]]:
    """How many cores this process may run on, and which CPUs (the affinity mask; a cgroup CPU
    quota lowers the count)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = list(range(os.cpu_count() or 1))
    n = len(cpus)
    quota = _cgroup_quota()
    if quota is not None:
        n = max(1, min(n, math.ceil(quota)))
    return n, cpus


def _cgroup_quota() -> float | None:
    """cgroup v2 ``cpu.max`` (or v1 ``cpu.cfs_quota_us``) as a number of cores; None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        p = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if q <= 0 else q / p
    except (OSError, ValueError):
        return None


def _cpu_times(cpus: list[int]) -> tuple[float, float] | None:
    """(idle, total) jiffies summed over ``cpus`` from /proc/stat; None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    want = {f"cpu{c}" for c in cpus}
    idle = total = 0.0
    seen = 0
    for line in lines:
        parts = line.split()
        if parts and parts[0] in want:
            v = [float(x) for x in parts[1:9]]  # user nice system idle iowait irq softirq steal
            idle += v[3] + v[4]
            total += sum(v)
            seen += 1
    return (idle, total) if seen else None


def idle_cores(cpus: list[int], seconds: float = SAMPLE_S) -> float | None:
    """Cores of ``cpus`` that sat idle during a short sample (this process sleeps meanwhile, so the
    busy time is other processes'); the 1-minute load average where /proc/stat is unreadable."""
    a = _cpu_times(cpus)
    if a is not None:
        time.sleep(seconds)
        b = _cpu_times(cpus)
        if b is not None and b[1] > a[1]:
            return len(cpus) * (b[0] - a[0]) / (b[1] - a[1])
    try:
        return max(0.0, len(cpus) - os.getloadavg()[0])
    except OSError:  # pragma: no cover
        return None


def _env_threads() -> tuple[int, str] | None:
    """A thread count the user set through the environment, or None. torchrun's own
    ``OMP_NUM_THREADS=1`` (set when it starts several local ranks and the user set nothing) is not
    the user's."""
    for key in ENV_KEYS:
        raw = os.environ.get(key, "").strip()
        if not raw:
            continue
        if key == "OMP_NUM_THREADS" and raw == "1" and _local_ranks() > 1:
            continue
        try:
            n = int(raw.split(",")[0])
        except ValueError:
            continue
        if n >= 1:
            return n, key
    return None


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _user_set_torch() -> int | None:
    """A ``torch.set_num_threads(n)`` made by the program that called unison (not by unison), or None:
    torch's count differs from the default torch picks for this affinity mask."""
    import torch

    n = torch.get_num_threads()
    if _torch_untouched or n == _applied:
        return None
    default = _physical_cores(usable_cores()[1])
    return n if n != default else None


def _physical_cores(cpus: list[int]) -> int:
    """Distinct physical cores among ``cpus`` (hyper-threads share one), as torch's default counts."""
    cores = set()
    for c in cpus:
        top = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add((top.joinpath("physical_package_id").read_text().strip(),
                       top.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("?", str(c)))
    return max(1, len(cores))


def decide(setting, params: int | None = None) -> Threads:
    """The thread count for ``setting`` (``auto`` or N) and its reason, for a model of ``params`` parameters
    (None: unknown); nothing is changed."""
    setting = parse_threads(setting)
    cores, cpus = usable_cores()
    ranks = _local_ranks()
    share = max(1, cores // ranks)
    where = f"{cores} core{'s' if cores != 1 else ''}" + (f" / {ranks} local ranks" if ranks > 1 else "")
    if setting != "auto":
        note = f"; more than the {where}" if setting > share else ""
        return Threads(setting, f"threads: {setting}{note}")
    env = _env_threads()
    if env is not None:
        return Threads(env[0], f"{env[1]}={env[0]}")
    user = _user_set_torch()
    if user is not None:
        return Threads(user, f"torch.set_num_threads({user})")
    if share == 1:
        return Threads(1, f"auto: {where}")
    if params is not None and params < SMALL_MODEL:
        return Threads(1, f"auto: a {size_text(params)}-parameter model's ops are too small to gain from more threads")
    if ranks > 1:  # the other ranks are starting too: their load is this job's own
        return Threads(share, f"auto: {where}")
    idle = idle_cores(cpus)
    size = f", a {size_text(params)}-parameter model" if params is not None else ""
    if idle is None:
        return Threads(share, f"auto: {where}{size}")
    free = max(1, min(share, math.floor(idle + 0.5)))
    if free < share:
        return Threads(free, f"auto: {where}, {cores - idle:.1f} of them busy with other processes")
    return Threads(free, f"auto: {where} idle{size}")


def setup(setting, params: int | None = None, log=None) -> Threads:
    """Decide (:func:`decide`) and give torch this process's thread count; ``log`` gets one line."""
    global _budget
    t = decide(setting, params=params)
    give(t.n)
    _budget = t.n
    if log is not None:
        log(str(t))
    return t


def give(n: int) -> None:
    """``torch.set_num_threads(n)``, remembered as unison's own choice (not the user's)."""
    global _applied
    import torch

    torch.set_num_threads(n)
    _applied = n


def budget() -> int:
    """The threads this process has to spend (what :func:`setup` decided)."""
    import torch

    return _budget or torch.get_num_threads()


def size_text(n: int) -> str:
    """A parameter count as people write it: 0.8M, 134.5M, 1.7B."""
    return f"{n / 1e6:.1f}M" if n < 1e9 else f"{n / 1e9:.1f}B"
