"""Learning-rate schedules and response-length surge detection (Paper B); the gradient noise lives in unison/optim.py.

A schedule is a small stateful object. ``lr(step)`` gives the LR of training
step ``step`` — numbered from 1, as ``"step"`` in metrics.jsonl — and
``observe(step, metrics)`` lets a schedule react to what step ``step``
measured (response length, mismatch, gradient noise) and returns its own
metrics. ``state_dict``/``load_state_dict`` carry the state through
checkpoints, so a resumed run keeps its schedule.
"""

from __future__ import annotations

import math
from collections import deque


class LRSchedule:
    """constant | warmup (linear over ``warmup_steps``, then constant) |
    cosine (warmup, then cosine from ``lr`` to ``min_lr_ratio·lr`` at the last step)."""

    def __init__(self, kind: str, base_lr: float, total_steps: int, warmup_steps: int = 0,
                 min_lr_ratio: float = 0.0):
        self.kind, self.base_lr, self.total = kind, base_lr, total_steps
        self.warmup, self.min_ratio = warmup_steps, min_lr_ratio

    def warmup_lr(self, step: int) -> float | None:
        if self.warmup and step <= self.warmup:
            return self.base_lr * step / self.warmup
        return None

    def lr(self, step: int) -> float:
        if self.kind != "constant":
            w = self.warmup_lr(step)
            if w is not None:
                return w
        if self.kind == "cosine":
            span = max(self.total - self.warmup - 1, 1)
            frac = min(max(step - self.warmup - 1, 0) / span, 1.0)
            return self.base_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        return self.base_lr

    def observe(self, step: int, metrics: dict) -> dict:
        """React to step ``step``'s metrics; return the schedule's own (no surge here: −1)."""
        return {"lr_schedule/surge_step": -1}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ------------------------------------------------------------------ surge detectors
class BaselineRatioDetector:
    """Baseline = mean of the signal over its first ``window`` observations; fires when
    the signal smoothed over the last ``smooth`` observations is ≥ ``multiplier`` × baseline
    for ``patience`` consecutive observations. (A public re-implementation of Paper B
    used window 50, multiplier 3.)"""

    def __init__(self, window: int = 50, multiplier: float = 3.0, patience: int = 1, smooth: int = 5):
        self.window, self.multiplier, self.patience, self.smooth = window, multiplier, patience, smooth
        self.baseline_values: list[float] = []
        self.recent: deque = deque(maxlen=smooth)
        self.streak = 0

    def update(self, value: float) -> tuple[bool, float | None]:
        self.recent.append(value)
        if len(self.baseline_values) < self.window:
            self.baseline_values.append(value)
            return False, None
        base = sum(self.baseline_values) / len(self.baseline_values)
        ratio = (sum(self.recent) / len(self.recent)) / base if base > 0 else None
        self.streak = self.streak + 1 if ratio is not None and ratio >= self.multiplier else 0
        return self.streak >= self.patience, ratio

    def state_dict(self):
        return {"baseline_values": list(self.baseline_values), "recent": list(self.recent),
                "streak": self.streak}

    def load_state_dict(self, s):
        self.baseline_values = list(s["baseline_values"])
        self.recent = deque(s["recent"], maxlen=self.smooth)
        self.streak = s["streak"]


class EMARatioDetector:
    """Fires when signal_t / EMA_{t−1}(signal) ≥ ``multiplier`` for ``patience`` consecutive
    observations. It never fires during the first ``cooldown`` observations (EMA burn-in)
    nor within ``cooldown`` observations after it fired."""

    def __init__(self, alpha: float = 0.1, multiplier: float = 1.5, patience: int = 3, cooldown: int = 10):
        self.alpha, self.multiplier, self.patience, self.cooldown = alpha, multiplier, patience, cooldown
        self.ema: float | None = None
        self.streak = 0
        self.quiet = cooldown  # observations left before firing is allowed

    def update(self, value: float) -> tuple[bool, float | None]:
        ratio = value / self.ema if self.ema not in (None, 0.0) else None
        self.ema = value if self.ema is None else (1 - self.alpha) * self.ema + self.alpha * value
        self.streak = self.streak + 1 if ratio is not None and ratio >= self.multiplier else 0
        if self.quiet > 0:
            self.quiet -= 1
            return False, ratio
        if self.streak >= self.patience:
            self.quiet, self.streak = self.cooldown, 0
            return True, ratio
        return False, ratio

    def state_dict(self):
        return {"ema": self.ema, "streak": self.streak, "quiet": self.quiet}

    def load_state_dict(self, s):
        self.ema, self.streak, self.quiet = s["ema"], s["streak"], s["quiet"]


TRIGGER_SIGNALS = {"length": "response_length/mean", "mismatch": "mismatch/k3",
                   "grad_noise": "grad_noise/noise_scale_ema"}


class SurgeDecaySchedule(LRSchedule):
    """Paper B's length-triggered step decay (docs/lr-schedule.md), with other triggers.

        phase 1: η(t) = η0 (after optional linear warmup) until a surge is detected at step t_s
        phase 2: T_decay = round(k · t_s);  η(t) = max(η0 · γ^⌊t' / T_decay⌋, ρ_min · η0)

    with t' = t (``count_from: start``, the default) or t' = t − t_s (``count_from: surge``).
    Counting from step 0 puts the first halving at step T_decay ≈ 1.8·t_s.
    ``trigger``: ``length`` (mean response length, the paper's), ``mismatch`` (token k3),
    ``grad_noise`` (EMA of the gradient noise scale). ``trigger_step`` fixes t_s by hand.
    """

    def __init__(self, base_lr: float, warmup_steps: int = 0, k: float = 1.8, gamma: float = 0.5,
                 rho_min: float = 0.1, count_from: str = "start", trigger: str = "length",
                 detector=None, trigger_step: int | None = None):
        super().__init__("surge", base_lr, 0, warmup_steps)
        self.k, self.gamma, self.rho_min, self.count_from = k, gamma, rho_min, count_from
        self.signal = TRIGGER_SIGNALS[trigger]
        self.detector = detector or BaselineRatioDetector()
        self.surge_step: int | None = trigger_step
        self.manual = trigger_step is not None
        self.last_ratio: float | None = None

    @property
    def period(self) -> int | None:
        return None if self.surge_step is None else max(1, round(self.k * self.surge_step))

    def lr(self, step: int) -> float:
        w = self.warmup_lr(step)
        if w is not None:
            return w
        if self.surge_step is None or step <= self.surge_step:
            return self.base_lr
        t = step if self.count_from == "start" else step - self.surge_step
        return max(self.base_lr * self.gamma ** (t // self.period), self.rho_min * self.base_lr)

    def observe(self, step: int, metrics: dict) -> dict:
        value = metrics.get(self.signal)
        if step > self.warmup and not self.manual and isinstance(value, (int, float)) and math.isfinite(value):
            fired, self.last_ratio = self.detector.update(float(value))
            if fired and self.surge_step is None:
                self.surge_step = step
        return {"lr_schedule/surge_step": self.surge_step if self.surge_step is not None else -1,
                "lr_schedule/phase": 1 if self.surge_step is None else 2,
                "lr_schedule/detector_ratio": self.last_ratio,
                "lr_schedule/decay_period": self.period if self.period is not None else -1}

    def state_dict(self) -> dict:
        return {"surge_step": self.surge_step, "last_ratio": self.last_ratio,
                "detector": self.detector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.surge_step, self.last_ratio = state["surge_step"], state["last_ratio"]
            self.detector.load_state_dict(state["detector"])


class MismatchBudgetSchedule(LRSchedule):
    """The LR follows the measured mismatch (``train.schedule: mismatch_budget``): Paper B's finding —
    the LR controls the mismatch — as a closed loop, in the manner of the adaptive-KL LR of PPO
    implementations (rsl_rl ``schedule: adaptive``, ``desired_kl``), with the training–inference
    mismatch in place of the policy KL. After step t has measured m_t (``metric``; token k3 by
    default, ``mismatch/staleness_k3`` under asynchronous rollout):

        f ← max(f · down, min_ratio)   if m_t > target
        f ← min(f · up, 1)             if m_t < target / 2
        f unchanged                    otherwise (and when m_t is missing or not finite)

    and step t + 1 runs at η = η0 · f (times the linear warm-up factor during ``warmup_steps``).
    f starts at ``start`` (1: the full LR). ``schedule/budget_state`` is −1 / 0 / +1 (lowered / held / raised),
    ``schedule/budget_factor`` is f after the step; both are checkpointed, so a resumed run keeps its LR.
    A step whose metrics lack ``metric`` (or hold a non-finite value) holds f and says so:
    ``schedule/budget_missing`` 1 (and ``missing_steps`` counts them, checkpointed): a held budget is never
    mistaken for one within its target. The trainer warns the first time, naming the nearest logged metric.
    """

    def __init__(self, base_lr: float, warmup_steps: int = 0, metric: str = "mismatch/k3",
                 target: float = 1e-2, down: float = 0.7, up: float = 1.1, min_ratio: float = 0.1,
                 start: float = 1.0):
        super().__init__("mismatch_budget", base_lr, 0, warmup_steps)
        self.metric, self.target, self.down, self.up, self.min_ratio = metric, target, down, up, min_ratio
        self.factor, self.state, self.missing_steps = start, 0, 0

    def lr(self, step: int) -> float:
        w = self.warmup_lr(step)
        return (self.base_lr if w is None else w) * self.factor

    def observe(self, step: int, metrics: dict) -> dict:
        value = metrics.get(self.metric)
        self.state = 0
        measured = isinstance(value, (int, float)) and math.isfinite(value)
        # a step that made no update (every group uniform: ``optim/steps`` 0) measures no mismatch: f held, and the
        # metric is not missing
        missing = not measured and metrics.get("optim/steps", 1) != 0
        if missing:
            self.missing_steps += 1
        if not measured:
            self.state = 0
        elif value > self.target:
            self.factor, self.state = max(self.factor * self.down, self.min_ratio), -1
        elif value < self.target / 2:
            self.factor, self.state = min(self.factor * self.up, 1.0), 1
        return {**super().observe(step, metrics), "schedule/budget_state": self.state,
                "schedule/budget_factor": self.factor, "schedule/budget_missing": int(missing)}

    def state_dict(self) -> dict:
        return {"factor": self.factor, "state": self.state, "missing_steps": self.missing_steps}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.factor, self.state = state["factor"], state["state"]
            self.missing_steps = state.get("missing_steps", 0)


def make_schedule(train_cfg, asynchronous: bool = False) -> LRSchedule:
    """The run's schedule. ``asynchronous``: the engine runs ahead (rollout.max_staleness ≥ 1), so the
    mismatch budget watches the staleness part of the mismatch by default."""
    if train_cfg.schedule == "mismatch_budget":
        b = train_cfg.mismatch_budget
        metric = b.metric or ("mismatch/staleness_k3" if asynchronous else "mismatch/k3")
        return MismatchBudgetSchedule(train_cfg.lr, train_cfg.warmup_steps, metric, b.target, b.down, b.up,
                                      b.min_ratio, b.start)
    if train_cfg.schedule == "surge_decay":
        s = train_cfg.surge
        if s.detector == "baseline_ratio":
            det = BaselineRatioDetector(s.window, s.multiplier, s.patience, s.smooth)
        else:
            det = EMARatioDetector(s.ema_alpha, s.multiplier, s.patience, s.cooldown)
        return SurgeDecaySchedule(train_cfg.lr, train_cfg.warmup_steps, s.k, s.gamma, s.rho_min,
                                  s.count_from, s.trigger, det, s.trigger_step)
    return LRSchedule(train_cfg.schedule, train_cfg.lr, train_cfg.steps, train_cfg.warmup_steps,
                      train_cfg.min_lr_ratio)
