"""A stand-in for the native engine inside a real rollout worker process (unison.rollout.worker).

``FakeSpec`` is a ``WorkerSpec`` whose unpickling — which happens in the spawned worker only —
replaces the worker's ``NativeEngine`` with :class:`FakeEngine`, so that faults can be staged in a
real process: results of several MiB, a generation that never ends, a slow weight load. The
parent process (pytest) never runs the replacement.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
from dataclasses import dataclass

from unison.batch import Completion
from unison.rollout.worker import WorkerSpec


@dataclass(frozen=True)
class FakeSpec(WorkerSpec):
    #: "echo": answer at once | "hang_after": generations after the first ``n`` never end |
    #: "sleep": every generation takes ``seconds`` | "slow_load": a weight load reads its first tensor,
    #: waits ``seconds``, then reads the others (the values it saw come back as the token ids)
    behaviour: str = "echo"
    n: int = 1
    seconds: float = 0.0
    #: megabytes of log-probs in each result (the size of a real batch's completions)
    payload_mib: float = 0.0
    #: a file written when a generation has returned (the result is then being sent); with "slow_load",
    #: when a load has read its first tensor (and waits)
    marker: str = ""

    def __reduce__(self):
        return _rebuild, ({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},)


def _rebuild(fields: dict) -> FakeSpec:
    global _SPEC
    import unison.rollout.native as native
    import unison.rollout.worker as worker

    native.NativeEngine = worker.NativeEngine = FakeEngine  # in the worker: its engine is this one
    _SPEC = FakeSpec(**fields)
    return _SPEC


_SPEC: FakeSpec | None = None


def spec(**kw) -> FakeSpec:
    import torch

    from unison.sides import Side

    base = dict(model_dir="-", side=Side(dtype=torch.float32), device="cpu", threads=1, dp_rank=0, dp_size=1)
    return FakeSpec(**{**base, **kw})


class FakeEngine:
    pad_id, eos_ids = 0, [1]

    def __init__(self, model_dir, side=None, device="cpu"):
        self.kernels = types.SimpleNamespace(compile_s=0.0)  # the native engine's: nothing compiled here
        self.seen: list[float] = []  # the first value of each weight tensor the last load read
        self.calls = 0

    def load_weights(self, named_tensors):
        items = list(named_tensors)
        self.seen = [float(items[0][1].flatten()[0])]
        if _SPEC.behaviour == "slow_load":
            if _SPEC.marker:
                with open(_SPEC.marker, "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(_SPEC.seconds)
        self.seen += [float(t.flatten()[0]) for _, t in items[1:]]
        return len(items)

    def generate(self, prompts, params):
        s = _SPEC
        self.calls += 1
        if s.behaviour == "hang_after" and self.calls > s.n:
            time.sleep(3600)
        if s.behaviour == "sleep":
            time.sleep(s.seconds)
        rows = len(prompts) * params.n
        size = max(len(self.seen), int(s.payload_mib * 2**20 / 9) // max(rows, 1))  # a pickled float: 9 bytes
        out = [Completion(prompt_ids=list(p), token_ids=[int(v) for v in self.seen] + [7] * (size - len(self.seen)),
                          logprobs=[-0.5] * size, finish_reason="length", prompt_index=pi, sample_index=si)
               for pi, p in enumerate(prompts) for si in range(params.n)]
        if s.marker and s.behaviour != "slow_load":
            with open(s.marker, "w") as f:
                f.write(str(os.getpid()))
        return out
