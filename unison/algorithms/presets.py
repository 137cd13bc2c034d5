"""Algorithm presets named as in Paper A, selected with ``algo: NAME``.

A preset fills every ``policy.*`` field the user left unset.
"""

from __future__ import annotations

from unison.errors import UnisonError

PRESETS: dict[str, dict] = {
    # Paper A's GRPO: Dr.GRPO advantages (no std), PPO-clip ε = 0.2, token sum / max length
    "grpo": dict(advantage="drgrpo", loss="ppo_clip", correction="none", correction_c=2.0,
                 clip=0.2, loss_agg="seq_mean_token_sum_norm"),
    # GRPO + Token-TIS: min(ρ_t, C) with C = 2 on each PPO term
    "grpo_token_tis": dict(advantage="drgrpo", loss="ppo_clip", correction="token_tis", correction_c=2.0,
                           clip=0.2, loss_agg="seq_mean_token_sum_norm"),
}


def resolve_policy(algo: str, policy) -> dict:
    """The effective policy settings: the preset, overridden by fields set in ``policy``."""
    if algo not in PRESETS:
        raise UnisonError(f"unknown algo '{algo}': choose one of {', '.join(PRESETS)}")
    out = dict(PRESETS[algo])
    for key, value in policy.model_dump().items():
        if value is not None:
            out[key] = value
    return out
