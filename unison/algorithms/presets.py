"""Algorithm presets named as in Paper A, selected with ``algo: NAME``.

A preset fills every ``policy.*`` field the user left unset. Thresholds are
the paper's (docs/papers.md, "Algorithms compared"): Token-TIS C = 2, Seq-MIS C = 10,
GSPO band [1−3e-4, 1+4e-4], PG-Seq-MIS C = 3, PPO ε = 0.2; the cures the field ships have their
sources' (IcePop [0.5, 5], IPO ε and τ, M2PO τ = 0.04: docs/algorithms.md).
"""

from __future__ import annotations

from unison.algorithms.corrections import BATCH_LEVEL, TOKEN_LEVEL
from unison.algorithms.losses import SELF_CORRECTING, SEQUENCE_LEVEL
from unison.errors import UnisonError

_GRPO = dict(advantage="drgrpo", loss="ppo_clip", correction="none", clip=0.2,
             loss_agg="seq_mean_token_sum_norm")
_PG = dict(advantage="drgrpo", correction="none", loss_agg="seq_mean_token_sum_norm")

PRESETS: dict[str, dict] = {
    # GRPO in Dr.GRPO form: A = R − group mean, PPO-clip ε = 0.2, Σ tokens / (responses × max length)
    "grpo": dict(_GRPO),
    # GRPO + Token-TIS: min(ρ_t, 2) on each PPO term
    "grpo_token_tis": dict(_GRPO, correction="token_tis", correction_c=2.0),
    # GRPO + Seq-MIS: ρ·1{ρ ≤ 10} on each PPO term (drop the response when ρ > 10)
    "grpo_seq_mis": dict(_GRPO, correction="seq_mis", correction_c=10.0),
    # GSPO: std-normalised group advantage, sequence-ratio clip band [1−3e-4, 1+4e-4], per-sequence token mean
    "gspo": dict(advantage="grpo", loss="gspo", correction="none", clip=3e-4, clip_high=4e-4,
                 loss_agg="seq_mean_token_mean"),
    # PG-Seq-IS: −sg[π(y)/μ(y)]·A·log π(y), unclipped (Paper A's favourite in FP16)
    "pg_seq_is": dict(_PG, loss="pg_seq_is"),
    # PG-Seq-MIS: as PG-Seq-IS, responses with π(y)/μ(y) > 3 masked out
    "pg_seq_mis": dict(_PG, loss="pg_seq_mis", loss_c=3.0),
    # PG-Token-IS: −sg[π(y_t)/μ(y_t)]·A·log π(y_t), unclipped
    "pg_token_is": dict(_PG, loss="pg_token_is"),
    # DPPO-Binary-TV (prime-rl's default): mask a token once π − π_old leaves ±0.2 in the advantage's
    # direction, ratio-weighted policy gradient elsewhere, + 1e-3·(log π − log π_old)²; with
    # policy.anchor=bypass π_old is μ, as in prime-rl
    # (the ratio weight capped at 20, verl's clip_ratio_c fallback: prime-rl has no cap, and off-policy data
    # can make π/μ unbounded where μ is tiny)
    "dppo_tv": dict(_PG, loss="dppo_tv", clip=0.2, clip_high=0.2, kl_tau=1e-3, loss_c=20.0),
    # DPPO-Binary-KL (verl dppo_kl): the band on the Bernoulli KL, δ = 0.05
    "dppo_kl": dict(_PG, loss="dppo_kl", clip=0.05, clip_high=0.05, loss_c=20.0),
    # IcePop (Ring-1T, arXiv 2510.18855): GRPO with a token's weight zeroed when π_old/μ leaves [0.5, 5]
    # (token_mis; verl rollout_is_threshold "0.5_5.0"); kept tokens are weighted by the ratio
    "grpo_icepop": dict(_GRPO, correction="token_mis", correction_c_low=0.5, correction_c=5.0),
    # IPO (prime-rl's default loss): mask a token when |π − π_old| > ε in probability, either sign of A;
    # ratio-weighted policy gradient elsewhere + τ·(log π/π_old)²; π_old is μ (bypass), as in prime-rl; the ratio
    # weight capped at 1e4 (prime-rl's max_importance_ratio: without it μ = 1e-6, π = 0.05 weighs 5e4)
    "ipo": dict(_PG, loss="ipo", clip=0.1, kl_tau=1e-3, anchor="bypass", loss_c=1e4),
    # M2PO (arXiv 2510.01161) as AReaL runs it: the decoupled loss (PPO clipped around the recomputed π_old,
    # behaviour weight π_old/μ, tokens above 5 masked) on the tokens left when those of largest
    # (log π_old − log μ)² are masked until the batch's mean second moment is below τ = 0.04
    "grpo_m2po": dict(_GRPO, correction="m2po", correction_c=0.04, correction_cap=5.0),
    # M2PO's mask alone, no behaviour weight (unison's grpo_m2po before it followed AReaL)
    "grpo_m2po_mask": dict(_GRPO, correction="m2po_mask", correction_c=0.04),
    # On-policy distillation (unison/algorithms/distill.py): PPO-clip on per-token advantages
    # −distill.coef·(log π_old − log π_teacher), the task's reward added with distill.task_reward; needs distill.teacher
    "opd": dict(_GRPO),
}
#: every preset shares Dr.GRPO's advantage (R − group mean) and normaliser Σ/(B·L_max) unless it names its own (GSPO):
#: arms of an experiment then differ in the correction alone. The cures' authors use others — IcePop's verl
#: recipes GRPO's std advantage and a token mean, IPO's prime-rl a token mean over the batch's loss tokens, AReaL's
#: M2PO group- then batch-normalised advantages and a token mean: set policy.advantage / policy.loss_agg to match
#: them (docs/algorithms.md, "Presets and their sources")

_POLICY_KEYS = ("advantage", "loss", "correction", "correction_c", "correction_c_low", "correction_cap", "veto_threshold",
                "clip", "clip_high", "loss_c", "loss_agg", "kl_tau", "anchor", "bypass")


def resolve_policy(algo: str, policy) -> dict:
    """The effective policy: the preset, overridden by every field set in ``policy``.

    Refuses combinations that do not make sense: a correction on a loss that
    already weights by π/μ (it would apply the ratio twice), and a token-level
    correction on a sequence-level loss.
    """
    if algo not in PRESETS:
        raise UnisonError(f"unknown algo '{algo}': choose one of {', '.join(PRESETS)}")
    out = {k: None for k in _POLICY_KEYS}
    out.update(PRESETS[algo])
    out["bypass"] = False
    for key, value in policy.model_dump().items():
        if value is not None:
            out[key] = value
    if out["bypass"]:  # policy.bypass: true is policy.anchor: bypass
        if out["anchor"] not in (None, "bypass"):
            raise UnisonError(f"policy.bypass is true but policy.anchor is '{out['anchor']}': set one of them "
                              f"(bypass ≡ anchor=bypass)")
        out["anchor"] = "bypass"
    out["anchor"] = out["anchor"] or "recompute"
    out["bypass"] = out["anchor"] == "bypass"
    if out["loss"] in SELF_CORRECTING and out["correction"] != "none":
        raise UnisonError(f"policy.correction '{out['correction']}' cannot be combined with loss "
                          f"'{out['loss']}', which already weights by π/μ: set policy.correction=none")
    if out["anchor"] == "bypass" and out["correction"] != "none":
        raise UnisonError(f"policy.correction '{out['correction']}' with policy.anchor=bypass: π_old is μ itself, so "
                          f"ρ = π_old/μ ≡ 1 and the correction would do nothing: set policy.anchor=recompute (the "
                          f"learner's π_old), or policy.correction=none")
    if out["anchor"] == "loglinear" and out["correction"] in BATCH_LEVEL:
        raise UnisonError(f"policy.correction '{out['correction']}' masks over the whole batch's tokens and needs π_old "
                          f"of every row before the update, which policy.anchor=loglinear interpolates per mini-batch: "
                          f"set policy.anchor=recompute")
    if out["loss"] in SEQUENCE_LEVEL and out["correction"] in TOKEN_LEVEL:
        raise UnisonError(f"token-level correction '{out['correction']}' does not compose with the "
                          f"sequence-level loss '{out['loss']}': use seq_tis, seq_mis, geo_rs or veto")
    return out


def correction_kwargs(policy: dict) -> dict:
    """Threshold arguments for the correction function; unset ones keep its own defaults."""
    kw = {"c": policy["correction_c"], "c_low": policy["correction_c_low"], "cap": policy["correction_cap"],
          "threshold": policy["veto_threshold"]}
    return {k: v for k, v in kw.items() if v is not None}


def loss_kwargs(policy: dict) -> dict:
    kw = {"clip": policy["clip"], "clip_high": policy["clip_high"], "loss_c": policy["loss_c"],
          "kl_tau": policy["kl_tau"]}
    return {k: v for k, v in kw.items() if v is not None}
