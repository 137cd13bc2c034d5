"""Where each step's batch comes from: the rollout source (the seam between the loop and the engines).

The trainer asks one object for the next batch (:meth:`RolloutSource.next`) and, after each
update, hands it the new weights (:meth:`RolloutSource.publish`). Two kinds:

* :class:`RolloutSource` — synchronous (``rollout.max_staleness: 0``, the default): the engine
  generates step t's batch when step t asks, with the weights of version t (every sample has
  staleness 0).
* :class:`AheadSource` — the engine runs ahead of the learner by at most K versions (K =
  ``rollout.max_staleness`` ≥ 1): batch j is submitted once version j − K exists and generated
  while the learner trains on earlier batches, by a native engine in a worker process of its own
  (:mod:`unison.rollout.worker`) or as requests in flight to a vLLM server (a generating thread).
  ``rollout.stale_policy`` says what the engine does when the weights a batch needs have not
  reached it: ``wait`` for them (batch j is then generated with exactly version max(0, j − K):
  deterministic), or ``drop``: sample with the newest weights it holds, and drop the samples
  that end up more than K versions older than the learner (whole groups, ``staleness/dropped``).

Both draw prompts, seed every prompt group, score rewards, gather the ranks' shares and apply
DAPO's uniform-group filter the same way; only *when* and *with which weights* generation runs
differs. Policy versions count weight updates: the learner at step t (0-based) holds version t.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

from unison.algorithms.advantages import uniform_groups
from unison.rollout import generate
from unison.rollout.backends import NativeWorkerBackend, ServerBackend, _sync_server
from unison.rollout.base import SamplingParams, Weights, mix64, push
from unison.sides import Side


class PromptSampler:
    """Epoch-wise shuffled pass over the training prompts; its position is checkpointed."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch, self.pos = size, seed, 0, 0
        self._perm = self._make_perm()

    def _make_perm(self):
        perm = list(range(self.size))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(perm)
        return perm

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._make_perm()
            take = min(k - len(out), self.size - self.pos)
            out += self._perm[self.pos:self.pos + take]
            self.pos += take
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s):
        self.epoch, self.pos = s["epoch"], s["pos"]
        self._perm = self._make_perm()


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


@dataclass
class Job:
    """One round of generation for training step ``step``: the prompts and their seeds."""

    step: int
    round: int
    prompts: list[int]          # indices into the training prompts, the whole global round
    seed: int
    #: the sampler's state before this job drew its prompts (a checkpoint taken while the job is
    #: in flight restores this, so that a resumed run draws the same prompts again)
    sampler_before: dict
    version: int | None = None  # the weights it must be generated with (None: the newest)
    id: int = 0  # the backend's handle on it


@dataclass
class Rollout:
    """What one step trains on, in global prompt order on every rank, and how it was obtained."""

    completions: list
    rewards: list[float]
    sampled_rewards: list[float]
    dropped_groups: int = 0
    reward_calls: int = 0
    reward_errors: int = 0
    last_error: str | None = None
    rounds: int = 0
    #: samples dropped because they were more than K versions old (stale_policy drop)
    stale_dropped: int = 0
    timings: dict = field(default_factory=dict)
    #: multi-turn tasks: the record of every episode sampled (unison/tasks/env.py), for rollout/* metrics
    episodes: list = field(default_factory=list)


class RolloutSource:
    """Synchronous rollouts: the engine generates each step's batch when it is asked for."""

    max_staleness = 0

    def __init__(self, engine, task, reward, tokenizer, prompt_ids, cfg, dist):
        self.engine, self.task, self.reward, self.tokenizer = engine, task, reward, tokenizer
        self.prompt_ids, self.cfg, self.dist = prompt_ids, cfg, dist
        self.sampler = PromptSampler(len(task.train), cfg.seed)
        self.dp_rank, self.dp_size = engine.dp_rank, engine.dp_size
        self.pad_id, self.eos_ids = engine.pad_id, engine.eos_ids

    # ------------------------------------------------------------------ the seam
    def next(self, step: int) -> Rollout:
        """Generate, score and (with DAPO) filter step ``step``'s groups."""
        cfg, r = self.cfg, self.cfg.rollout
        P = cfg.train.prompts_per_step
        out = Rollout([], [], [])
        t_start = time.perf_counter()
        t_wait = t_gen = t_idle = 0.0
        while True:
            job = self._job(step, out.rounds)
            t0 = time.perf_counter()
            comps, gen_s, idle_s = self._generate(job)
            t_wait += time.perf_counter() - t0
            t_gen, t_idle = t_gen + gen_s, t_idle + idle_s
            lo, hi = self.share(P)
            items = [self.task.train[i] for i in job.prompts[lo:hi]]
            calls, errors = self.reward.calls, self.reward.errors
            rw = self.reward.score_completions(comps, items, self.tokenizer)
            for c in comps:  # group id = place in the global batch, unique across oversampling rounds
                c.prompt_index = c.prompt_index + lo + out.rounds * P
            parts = self.gather((comps, rw, self.reward.calls - calls, self.reward.errors - errors,
                                  self.reward.last_error))
            comps = [c for p in parts for c in p[0]]
            out.episodes += [c.episode for c in comps if c.episode is not None]
            rw = [x for p in parts for x in p[1]]
            out.reward_calls += sum(p[2] for p in parts)
            out.reward_errors += sum(p[3] for p in parts)
            out.last_error = next((p[4] for p in parts if p[4]), out.last_error)
            out.sampled_rewards += rw
            comps, rw, stale = self._drop_stale(step, comps, rw)
            out.stale_dropped += stale
            if cfg.train.drop_uniform_groups:
                rt, gid = torch.tensor(rw), torch.tensor([c.prompt_index for c in comps])
                keep = ~uniform_groups(rt, gid) if comps else torch.zeros(0, dtype=torch.bool)
                out.dropped_groups += int((~keep).sum()) // r.n
                comps = [c for c, k in zip(comps, keep.tolist()) if k]
                rw = [x for x, k in zip(rw, keep.tolist()) if k]
            out.completions += comps
            out.rewards += rw
            out.rounds += 1
            enough = len(out.completions) >= P * r.n
            refill = cfg.train.drop_uniform_groups or out.stale_dropped
            if not refill or enough or out.rounds > cfg.train.oversample_rounds:
                break
        if len(out.completions) > P * r.n:  # oversampling overshot: train on the configured batch (whole groups)
            out.completions, out.rewards = out.completions[:P * r.n], out.rewards[:P * r.n]
        out.timings = {"time/rollout_s": time.perf_counter() - t_start, "time/generate_s": t_gen,
                       "time/learner_idle_s": t_wait}
        if self.max_staleness:
            out.timings["time/engine_idle_s"] = t_idle
        return out

    def publish(self, weights: Weights, version: int) -> dict[str, float]:
        """The policy's weights after ``version`` updates go to the engine (collective when sharded)."""
        return push(self.engine, weights)

    def weights(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of an older ``version``, if this source keeps them (for the mismatch split)."""
        return None

    def kept_versions(self, step: int) -> dict:
        """Nothing in flight between steps: no older version to keep (see :class:`AheadSource`)."""
        return {}

    def resume(self, weights: Weights, step: int, kept: dict | None = None) -> None:
        """After a checkpoint was loaded: the engine takes its weights (version ``step``)."""
        push(self.engine, weights)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def generate(self, prompts, params):
        """Generate outside the training batches (evaluation), with the newest weights."""
        return generate(self.engine, prompts, params)

    def sleep(self) -> None:
        """Free the engine's accelerator memory for the update (a colocated vLLM with sleep mode)."""
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        self.engine.close()

    # --------------------------------------------------------------- internals
    def _job(self, step: int, round_: int) -> Job:
        before = self.sampler.state_dict()
        idx = self.sampler.next(self.cfg.train.prompts_per_step)
        return Job(step, round_, idx, step_seed(self.cfg.seed, step) + 104729 * round_, before)

    def _params(self, job: Job) -> SamplingParams:
        r, P = self.cfg.rollout, self.cfg.train.prompts_per_step
        lo, hi = self.share(P)
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=r.max_new_tokens, seed=job.seed,
                              prompt_seeds=tuple(mix64(job.seed, j) for j in range(lo, hi)))

    def _my_prompts(self, job: Job) -> list[list[int]]:
        lo, hi = self.share(self.cfg.train.prompts_per_step)
        if self.task.multi_turn:  # episodes: run where the engine runs, turn by turn
            return self.task.episodes([self.task.train[i] for i in job.prompts[lo:hi]])
        return [self.prompt_ids[i] for i in job.prompts[lo:hi]]

    def _generate(self, job: Job):
        """``(completions of this replica's share, generating seconds, engine idle seconds)``."""
        t0 = time.perf_counter()
        comps = generate(self.engine, self._my_prompts(job), self._params(job))
        for c in comps:
            c.set_version(job.step)
        return comps, time.perf_counter() - t0, 0.0

    def _drop_stale(self, step, comps, rewards):
        return comps, rewards, 0

    def share(self, k: int) -> tuple[int, int]:
        """This engine replica's contiguous slice of ``k`` prompts."""
        n, r = self.dp_size, self.dp_rank
        return r * k // n, (r + 1) * k // n

    def gather(self, payload) -> list:
        """Every replica's ``payload``, in replica order, on every rank (the ranks of one
        tensor-parallel vLLM replica hold the same one: it is taken once)."""
        seen, out = set(), []
        for dp_rank, p in self.dist.all_gather_object((self.dp_rank, payload)):
            if dp_rank not in seen:
                seen.add(dp_rank)
                out.append(p)
        return out


class AheadSource(RolloutSource):
    """The engine generates up to K batches ahead of the learner (``rollout.max_staleness: K``).

    ``backend`` generates jobs in the background: :class:`NativeWorkerBackend` (a worker process
    fed through shared memory) or :class:`ServerBackend` (requests in flight to a vLLM server).
    """

    def __init__(self, backend, task, reward, tokenizer, prompt_ids, cfg, dist):
        self.backend = backend
        super().__init__(backend, task, reward, tokenizer, prompt_ids, cfg, dist)
        self.max_staleness = cfg.rollout.max_staleness
        self.wait = cfg.rollout.stale_policy == "wait"
        self.floor = 0  # after a resume, the oldest version the engine holds (a kept one, or the checkpoint's)
        self.inflight: deque[Job] = deque()
        self.next_job = 0  # the step of the next round-0 job to submit
        self._jobs = 0
        self._restored: list[Job] = []  # jobs that were in flight at the checkpoint a run resumed from

    def next(self, step: int) -> Rollout:
        self._fill(step)
        return super().next(step)

    def _fill(self, step: int) -> None:
        """Submit round 0 of every step up to ``step + K`` (the weights they need exist by now). Jobs past the
        run's last step draw their prompts (a longer run draws the same, and checkpoints record them) but are
        never generated."""
        K = self.max_staleness
        while self.next_job <= step + K:
            j = self.next_job
            job = self._restored.pop(0) if self._restored and self._restored[0].step == j else super()._job(j, 0)
            job.version = max(0, j - K, self.floor) if self.wait else None
            if j < self.cfg.train.steps:
                self._submit(job)
            else:
                self.inflight.append(job)
            self.next_job += 1

    def _submit(self, job: Job) -> None:
        self._jobs += 1
        job.id = self._jobs
        self.backend.submit(job.id, self._my_prompts(job), self._params(job), job.version)
        self.inflight.append(job)

    def _job(self, step: int, round_: int) -> Job:
        """Round 0 was submitted ahead; refill rounds (DAPO, dropped stale groups) are generated now,
        with the newest weights, after the batches already in flight."""
        if round_ == 0:
            return next(j for j in self.inflight if j.step == step and j.round == 0)
        job = super()._job(step, round_)
        job.version = max(step, self.floor) if self.wait else None
        self._submit(job)
        return job

    def _generate(self, job: Job):
        comps, _, gen_s, idle_s = self.backend.collect(job.id)
        self.inflight.remove(job)
        return comps, gen_s, idle_s

    def _drop_stale(self, step, comps, rewards):
        """Drop whole groups with a sample older than step − K (only ``stale_policy: drop`` makes any)."""
        limit = step - self.max_staleness
        old = {c.prompt_index for c in comps if c.versions[0] < limit}
        if not old:
            return comps, rewards, 0
        keep = [c.prompt_index not in old for c in comps]
        return ([c for c, k in zip(comps, keep) if k], [x for x, k in zip(rewards, keep) if k],
                sum(1 for k in keep if not k))

    def publish(self, weights: Weights, version: int) -> dict[str, float]:
        return self.backend.publish(weights, version)

    def weights(self, version: int):
        return self.backend.weights(version)

    def kept_versions(self, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The weights of the versions older than ``step`` that the round-0 jobs in flight are (to be)
        generated with (``stale_policy: wait``: version max(0, j − K) for batch j): a checkpoint at
        ``step`` keeps them, so that a resumed run generates those batches as the uninterrupted run
        does. Empty where the backend holds no copies (a vLLM server) or jobs take the newest (``drop``)."""
        wanted = sorted({j.version for j in self.inflight
                         if j.round == 0 and j.version is not None and j.version < step})
        return {v: w for v in wanted if (w := self.backend.weights(v)) is not None}

    def resume(self, weights: Weights, step: int, kept: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        """Batches in flight at the checkpoint were lost with the process: the same jobs (prompts and
        seeds, recorded in the checkpoint) are generated again. With the older versions they need
        (``kept``, from the checkpoint: the native worker's) the engine gets those first, and the
        resumed run trains on exactly the uninterrupted run's batches; without them (a vLLM server, or
        a checkpoint written before unison kept them) from the checkpoint's weights (version ``step``),
        so the first K batches are fresher than the run would have trained on. Nothing is trained twice
        or skipped either way."""
        kept = kept or {}
        for v in sorted(kept):
            self.backend.publish_weights(v, kept[v])
        self.floor = min(kept, default=step)
        self.backend.publish(weights, step)
        self.next_job = step

    def sleep(self) -> None:
        """The engine runs beside the learner: nothing to free."""

    def wake(self) -> None:
        pass

    def state_dict(self) -> dict:
        """The sampler where the run left it, and the round-0 jobs in flight (not trained on yet);
        ``sampler`` alone, for older readers, is its state before the oldest of them drew."""
        jobs = [j for j in self.inflight if j.round == 0]
        return {"sampler": jobs[0].sampler_before if jobs else self.sampler.state_dict(),
                "sampler_now": self.sampler.state_dict(),
                "inflight": [{"step": j.step, "prompts": list(j.prompts), "seed": j.seed} for j in jobs]}

    def load_state_dict(self, state: dict) -> None:
        if "inflight" not in state:  # written by the synchronous source, or by an older unison
            return super().load_state_dict(state)
        self.sampler.load_state_dict(state["sampler_now"])
        self._restored = [Job(j["step"], 0, j["prompts"], j["seed"], state["sampler"]) for j in state["inflight"]]

    def close(self) -> None:
        self.backend.close()


def make_source(cfg, engine_factory, task, reward, tokenizer, prompt_ids, dist, weights: Weights, model_dir,
                side: Side):
    """The synchronous source (K = 0) or the one that runs ahead (K ≥ 1) for this config; ``weights``: the policy's
    (version 0, :func:`unison.sync.weights_of`); ``side``: the engine's numerics (the run's machine)."""
    K = cfg.rollout.max_staleness
    if K == 0:
        engine = engine_factory()
        try:
            _sync_server(engine, weights)
        except BaseException:
            engine.close()
            raise
        return RolloutSource(engine, task, reward, tokenizer, prompt_ids, cfg, dist)
    if cfg.engine == "native":
        backend = NativeWorkerBackend(model_dir, side, weights.device, cfg.rollout, dist, weights.shapes())
        start = partial(backend.publish, weights, 0)
    else:
        engine = engine_factory()
        backend = ServerBackend(engine, cfg.rollout)
        start = partial(_sync_server, engine, weights)
    try:  # version 0 reaches the engine before the first batch is submitted
        start()
        return AheadSource(backend, task, reward, tokenizer, prompt_ids, cfg, dist)
    except BaseException:
        backend.close()  # a worker process or a server's threads end with the failure
        raise
