"""What a step measures, and the watchdogs that read it.

* :func:`timed` — a timer context (verl's ``marked_timer``): ``with timed("time/update_s", metrics): ...``.
* :func:`rollout_metrics`, :func:`batch_metrics` — pure functions of what the rollout source returned and of the
  trained batch: rewards, errors, lengths, staleness, episodes.
* :class:`Mismatch` — the mismatch of the learner's π_old against μ on the sampled tokens, the corrections'
  figures, MoE routing, and on decompose steps the numerics/staleness split and the mismatch ledger
  (unison/ledger.py). It scores (the split and the ledger need the learner), so it is built once per run with what
  it reads.
* :class:`Watchdogs` — the run's warnings and stops: reward functions that raise, responses cut and scored without
  a call, steps with nothing to learn, a mismatch budget whose metric is missing. Its counters are checkpointed.
"""

from __future__ import annotations

import contextlib
import difflib
import time

import numpy as np
import torch

from unison import moe
from unison.batch import by_version
from unison.errors import UnisonError
from unison.exact_check import divergence_report
from unison.ledger import shares
from unison.mismatch import k1, k3, mismatch_metrics
from unison.runlog import plural
from unison.tasks.env import episode_metrics


@contextlib.contextmanager
def timed(key: str, metrics: dict):
    """``metrics[key]`` += the seconds the block took."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


def rollout_metrics(step: int, roll, reward_errors: int) -> dict:
    """Step ``step``'s (0-based) rollout: mean sampled reward, reward calls and errors (``reward_errors``: the run's
    total so far, this step's included), dropped groups, the source's timings, the episodes' figures."""
    sampled = roll.sampled_rewards
    return {"step": step + 1, "reward/mean": float(np.mean(sampled)) if sampled else float("nan"),
            "data/dropped_groups": roll.dropped_groups, "reward/errors": reward_errors,
            "reward/error_count": roll.reward_errors, "reward/calls": roll.reward_calls,
            "reward/error_fraction": roll.reward_errors / max(roll.reward_calls, 1),
            "staleness/dropped": roll.stale_dropped, **roll.timings, **episode_metrics(roll.episodes)}


def batch_metrics(batch, step: int) -> dict:
    """The trained batch: staleness (versions behind step ``step``, per sampled token: a response a weight sync
    reached mid-way counts each token from the version that sampled it), the fraction of responses sampled under
    more than one version (the vLLM server with in-flight syncs), rewards, response lengths, truncation."""
    mask = batch.response_mask.bool()
    stale = (step - batch.token_versions(step))[mask].float()
    if not stale.numel():  # no sampled token: each response's first version
        stale = (step - batch.version).float() if batch.version is not None else torch.zeros(1)
    lengths = batch.response_lens.float()
    return {"staleness/mean": float(stale.mean()), "staleness/max": float(stale.max()),
            "staleness/spanning_fraction": float(batch.spanning().float().mean()),
            "reward/trained_mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response/truncated_fraction": float(batch.truncated.float().mean())}


class Mismatch:
    """μ against the learner's π_old on a trained batch, where π_old is known exactly (the step's
    :class:`~unison.algorithms.anchors.Known`), and on decompose steps (``every``) the mismatch ledger's terms and the
    numerics/staleness split. ``learner`` scores the split's passes (under the older weights ``source.weights``
    keeps); ``exact``: exact mode, where any difference is a bug and stops the run; ``split_every_step``: the mismatch
    budget watches the staleness part; ``log``: the run's warnings and, with ``console``, the ledger's line."""

    def __init__(self, every: int, learner, source, ledger=None, exact: bool = False, split_every_step: bool = False,
                 log=lambda m: None, console: bool = True):
        self.every, self.learner, self.source, self.ledger, self.exact = every, learner, source, ledger, exact
        self.split_every = 1 if split_every_step else every
        self.log, self.console = log, console

    def ledger_due(self, step: int) -> bool:
        return self.ledger is not None and not (step + 1) % self.every

    def measure(self, batch, known, step: int, chain=None, t_ledger: float = 0.0) -> dict:
        """The step's mismatch metrics on ``known``'s rows; ``chain``: the ledger's passes scored before the update
        (:meth:`ledger_due` steps)."""
        rows, logp_pi, mask = known.rows, known.logp, batch.response_mask
        mm = mismatch_metrics(logp_pi[rows], batch.logp_mu[rows], mask[rows])
        if self.exact and mm["mismatch/identical_fraction"] < 1.0:
            where = divergence_report(self.learner, self.source.engine, batch, rows, logp_pi)
            raise UnisonError(f"exact mode broke at step {step + 1}: log μ and log π_old differ ({where}); "
                              f"this is a bug in unison — please report it with the config")
        if known.routing is not None and "routing" in batch.extras:
            mm["mismatch/router_disagreement"] = moe.disagreement(batch.extras["routing"][rows],
                                                                  known.routing[rows], mask[rows])
        return {**mm, **known.corrections, **self._ledger(batch, rows, logp_pi, step, chain, t_ledger),
                **self._split(batch, rows, logp_pi, step)}

    def _ledger(self, batch, rows, logp_pi, step: int, chain, t_ledger: float) -> dict:
        """The mismatch ledger of this step's batch from the chain :meth:`Ledger.prepare` scored before the update,
        with its console line; warns once about a stale engine."""
        if chain is None:
            return {}

        t0 = time.perf_counter()
        m = self.ledger.measure(batch.select(rows), logp_pi[rows], step, chain, rows)
        m["time/ledger_s"] = t_ledger + time.perf_counter() - t0
        if self.console:
            self.log(f"[train] step {step + 1} {shares(m)}")
        self.ledger.check_stale(m, self.log)
        return m

    def _split(self, batch, rows, logp_pi, step: int) -> dict:
        """``numeric``: μ against the learner under the weights that sampled (same version, other numerics);
        ``staleness``: those weights against the current ones; with LoRA, ``merge``: the current weights merged as the
        engine holds them against the learner's adapters (π_old) — the engine samples merged weights of every version
        and the learner scores the current one through its adapters, a difference of rounding, not of age. The
        log-ratios add up to log π_old − log μ, so k1 adds up exactly; k3 up to cross terms (docs/async.md)."""
        if not self.split_every or (step + 1) % self.split_every:
            return {}
        mu, mask, pi = batch.logp_mu[rows], batch.response_mask[rows], logp_pi[rows]
        lora = getattr(self.learner, "peft", None) is not None and getattr(self.learner, "qat", None) is None \
            and self.learner.can_score_other_weights  # (sharded: no merged pass; the merge stays in the numerics)
        reused = self.ledger.split(step) if self.ledger is not None else None  # the ledger scored them already
        if reused is not None and (reused[1] is not None or not lora):
            behave, now = reused
        else:  # each token under the weights that sampled it (π_old's own where that is this step's, but for LoRA)
            sub = batch.select(rows)
            older = set(sub.token_versions(step).unique().tolist()) - {step}
            if older and not self.learner.can_score_other_weights:
                return {}
            weights = {u: self.source.weights(u) for u in older}
            if any(w is None for w in weights.values()):
                return {}
            merged = dict(self.learner.export_weights()) if lora else None
            weights[step] = merged
            now = self.learner.score(sub, weights=merged) if lora else None
            behave = by_version(sub, lambda part, u: self.learner.score(part, weights=weights[u]), step,
                                out=(pi if now is None else now).clone(), skip={step})
        at_now = pi if now is None else now
        out = {"mismatch/numeric_k3": float(k3(behave, mu, mask)),
               "mismatch/staleness_k3": float(k3(at_now, behave, mask)),
               "mismatch/numeric_k1": float(k1(behave, mu, mask)),
               "mismatch/staleness_k1": float(k1(at_now, behave, mask))}
        if now is not None:
            out.update({"mismatch/merge_k3": float(k3(pi, now, mask)), "mismatch/merge_k1": float(k1(pi, now, mask))})
        return out


class Watchdogs:
    """The run's warnings (each once, or once per streak) and the stop on rewards that keep raising."""

    def __init__(self, task_cfg, no_signal_steps: int, max_new_tokens: int, task_name: str, log, saved=lambda: []):
        self.task, self.no_signal_steps, self.max_new_tokens = task_cfg, no_signal_steps, max_new_tokens
        self.task_name, self.log = task_name, log
        #: the run's checkpoints, newest last (what a stop on failing rewards points to)
        self.saved = saved
        self.reward_errors = 0
        self.failed_reward_steps = 0
        self.quiet_steps = 0  # consecutive steps without a learning signal
        self.truncation_warned = self.budget_warned = False

    def state_dict(self) -> dict:
        return {"reward_errors": self.reward_errors, "failed_reward_steps": self.failed_reward_steps}

    def load_state_dict(self, state: dict) -> None:
        self.reward_errors = state.get("reward_errors", 0)
        self.failed_reward_steps = state.get("failed_reward_steps", 0)

    def rollout(self, step: int, roll, env: str | None = None) -> dict:
        """The rollout's metrics (:func:`rollout_metrics`), after the reward and truncation checks."""
        self.reward_errors += roll.reward_errors
        metrics = rollout_metrics(step, roll, self.reward_errors)
        self._reward_errors(metrics, roll, env)
        self._truncation(metrics, roll)
        return metrics

    def _reward_errors(self, metrics: dict, roll, env: str | None) -> None:
        """Errors are counted over the calls actually made (truncated responses make none); a step in
        which every call raised is a failed step, and ``task.reward_error_patience`` of them stop the run."""
        t, calls, errors = self.task, roll.reward_calls, roll.reward_errors
        if errors and errors / max(calls, 1) > t.reward_error_warn:
            self.log(f"[train] WARNING step {metrics['step']}: {errors} of {calls} rewards raised "
                     f"(scored 0); last: {roll.last_error}")
        if calls:  # a step that made no call (every response truncated) neither fails nor clears the count
            self.failed_reward_steps = self.failed_reward_steps + 1 if errors >= calls else 0
        if t.reward_error_patience and self.failed_reward_steps >= t.reward_error_patience:
            fn = t.reward or f"the {self.task_name} task's verifier"
            saved = self.saved()
            then = (f"continue with --resume from the last checkpoint ({saved[-1].name})" if saved else
                    "rerun with --resume: no checkpoint was saved yet, so it starts again from step 0")
            what = f"every call of the reward function {fn} raised" if t.reward or not env \
                else f"every episode of the environment {env} failed"
            raise UnisonError(f"{what} for {self.failed_reward_steps} "
                              f"consecutive step{'s' if self.failed_reward_steps != 1 else ''} (last: "
                              f"{roll.last_error}): fix it and {then}")

    def _truncation(self, metrics: dict, roll) -> None:
        """One warning, the first time more than half of a step's responses were cut at max_new_tokens and
        scored task.truncated_reward without a call of the verifier (or of the user's reward)."""
        t, comps = self.task, roll.completions
        if self.truncation_warned or t.truncated_reward is None or not comps:
            return
        cut = sum(c.finish_reason == "length" for c in comps) / len(comps)
        if cut > 0.5:
            self.truncation_warned = True
            fn = t.reward or f"the {self.task_name} task's verifier"
            self.log(f"[train] WARNING step {metrics['step']}: {cut:.0%} of the responses hit "
                     f"rollout.max_new_tokens={self.max_new_tokens} and scored "
                     f"task.truncated_reward={t.truncated_reward:g} without a call of {fn}: raise "
                     f"rollout.max_new_tokens, or set task.truncated_reward=null to grade them")

    def signal(self, metrics: dict, batch) -> None:
        """One warning when ``train.no_signal_steps`` steps in a row had nothing to learn from: every
        group's rewards equal (zero advantages) or a zero gradient."""
        patience = self.no_signal_steps
        uniform = batch is None or float(batch.advantages.abs().max()) == 0.0
        zero_grad = metrics.get("optim/grad_norm") == 0.0
        metrics["train/no_signal"] = int(uniform or zero_grad)
        self.quiet_steps = self.quiet_steps + 1 if (uniform or zero_grad) else 0
        if patience and self.quiet_steps == patience:
            trunc = metrics.get("response/truncated_fraction")
            graded = self.task.truncated_reward is None  # cut responses were graded: not why rewards are equal
            why = "every group's rewards were equal (zero advantage)" if uniform else "the gradient was zero"
            hint = (f"{trunc:.0%} of responses hit rollout.max_new_tokens and scored task.truncated_reward "
                    f"without a reward call: raise rollout.max_new_tokens" if trunc and trunc > 0.5 and not graded
                    else "the prompts are all too hard or all solved: use an easier set or `unison filter`")
            self.log(f"[train] WARNING nothing is being learned: for {plural(patience, 'step')} {why}; {hint}, or change "
                     f"the reward (train.no_signal_steps silences this)")

    def budget(self, metrics: dict, schedule) -> None:
        """One warning the first time the mismatch budget's metric is missing from a step."""
        if not metrics.get("schedule/budget_missing") or self.budget_warned:
            return
        self.budget_warned = True
        near = difflib.get_close_matches(schedule.metric, [k for k in metrics if "/" in k], n=1, cutoff=0.5)
        self.log(f"[train] WARNING step {metrics['step']}: train.schedule=mismatch_budget watches "
                 f"'{schedule.metric}', which this step did not log: the LR factor is held at "
                 f"{schedule.factor:g} (schedule/budget_missing); "
                 f"{f'did you mean {near[0]!r}? ' if near else ''}set train.mismatch_budget.metric to a "
                 f"metric the run logs every step (mismatch/k3)")
