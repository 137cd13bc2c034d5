"""What a run says when it starts: one line per thing a user should know before the first step.

Every line names the config key that changes it. Pure: :func:`startup_lines` reads the built trainer and returns
the lines; the trainer prints them.
"""

from __future__ import annotations

from unison.models import unknown_characters
from unison.quant import quantization_warning
from unison.runlog import plural
from unison.tasks.env import describe


def startup_lines(tr) -> list[str]:
    """What a run says when it starts (``tr``: the built :class:`unison.trainer.Trainer`), one line each: warnings,
    the task and the machine, the method, the ledger, what a cut response scores, the checkpoints."""
    cfg, t, r = tr.cfg, tr.cfg.train, tr.cfg.rollout
    out = []
    warning = quantization_warning(r.quantization, tr.policy, t.quantization_aware)
    if warning:
        out.append(f"[train] WARNING {warning}")
    if tr.learner.packing_note:
        out.append(f"[train] train.packing: {tr.learner.packing_note}")
    if tr.task.multi_turn:
        out.append(describe(tr.task, cfg))
    ahead = f", engine up to {plural(r.max_staleness, 'version')} ahead ({r.stale_policy})" if r.max_staleness else ""
    if r.max_staleness and cfg.mismatch.decompose_every and not tr.learner.can_score_other_weights:
        out.append("[train] the split of the mismatch into numerics and staleness scores with older weights in one "
                   "process, not under FSDP2 nor with LoRA under the quantization-aware learner: it is off here (mismatch/k3 is "
                   "still logged)")
    out.append(f"[train] {tr.task.name}: {plural(len(tr.task.train), 'training prompt')}, {len(tr.task.eval)} eval; "
               f"{plural(t.prompts_per_step, 'prompt')} x {plural(r.n, 'sample')} per step, {plural(t.steps, 'step')}; "
               f"precision {tr.prec.label}"
               f"{'' if r.quantization == 'none' else f', rollout weights {r.quantization}'}, engine {cfg.engine}"
               f"{ahead}, world size {tr.dist.world_size}; {tr.machine.threads}; {tr.machine.gemm}; "
               f"{tr.machine.compilation}")
    out.append(f"[train] {method_line(tr)}")
    if tr.ledger is not None:
        p = tr.ledger.plan
        missing = "".join(f"; {t} not measured ({why}), merged into its neighbour" for t, why in p.unmeasured.items())
        out.append(f"[train] mismatch ledger every {cfg.mismatch.decompose_every} steps: {', '.join(p.measured)}"
                   f"{missing} (mismatch.ledger)")
    if tr.task.name == "math":
        out.append(f"[train] math prompts: task.template {tr.task.template!r}")
    if cfg.task.reward and cfg.task.truncated_reward is not None:
        out.append(f"[train] a response cut at rollout.max_new_tokens={r.max_new_tokens} scores "
                   f"task.truncated_reward={cfg.task.truncated_reward:g} without a call of your reward "
                   f"({cfg.task.reward}); set task.truncated_reward=null to grade it too")
    unknown = unknown_characters(tr.tokenizer, [it.prompt for it in tr.task.train], tr.prompt_ids, "prompts")
    if unknown:
        out.append(f"[train] WARNING {unknown}")
    if getattr(tr.tokenizer, "chat_template", None) is None and tr.task.name in ("math", "jsonl"):
        out.append("[train] the model has no chat template: prompts go to it as raw text")
    n = sum(p.numel() for p in tr.learner.model.parameters())
    c = cfg.checkpoint
    when = " and ".join(x for x in (f"every {plural(c.every, 'step')}" if c.every else "",
                                    f"every {c.every_minutes:g} min" if c.every_minutes else "") if x)
    r = cfg.rollout  # async on the native engine: the older versions the batches in flight need, for an exact resume
    older = r.max_staleness if cfg.engine == "native" and r.stale_policy == "wait" else 0
    what = "fp32 weights + AdamW state" + (f" + up to {plural(older, 'older version')} for the batches in flight"
                                           if older else "")
    out.append(f"[train] checkpoints: {when + ', ' if when else ''}on SIGTERM / Ctrl-C and at the end; "
               f"≈{(12 + 4 * older) * n / 2**30:.2g} GiB each ({what}), {c.keep} kept (checkpoint.every, every_minutes, keep)")
    return out


def method_line(tr) -> str:
    """What the run trains and how it samples, in one line: the algorithm, LoRA, packing, top-p/top-k."""
    cfg, p, r = tr.cfg, tr.policy, tr.cfg.rollout
    algo = (f"algo {cfg.algo} (advantage {p['advantage']}, loss {p['loss']}, correction {p['correction']}, "
            f"π_old {p['anchor']})")
    if cfg.distill.teacher:
        d = cfg.distill
        algo += (f"; distilling from {d.teacher}: per-token advantage −{d.coef:g}·(log π_old − log π_teacher)"
                 f"{' + the task reward' if d.task_reward else ', the task reward not added'}")
    lora = (f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {cfg.lora.target_modules}: only the adapters "
            f"train and checkpoints hold the adapters (PEFT format), the engine gets the merged weights"
            if cfg.lora.rank else "full fine-tuning")
    packing = "packing on" if tr.learner.packing else "packing off"
    cut = [x for x in (f"top-p {r.top_p:g}" if r.top_p < 1 else "", f"top-k {r.top_k}" if r.top_k else "") if x]
    if not cut:
        sampling = f"sampling at temperature {r.temperature:g} from the full distribution"
    elif r.replay_sampling_mask:
        sampling = (f"sampling at temperature {r.temperature:g} with {' and '.join(cut)}: log μ is that of the "
                    f"truncated distribution, and the learner renormalises π over the same support "
                    f"(rollout.replay_sampling_mask)")
    else:
        sampling = (f"sampling at temperature {r.temperature:g} with {' and '.join(cut)}: log μ is that of the "
                    f"truncated distribution, which the learner does not score — it adds −log(kept mass) to "
                    f"the mismatch (rollout.replay_sampling_mask=true renormalises π over the sampled support)")
    return f"{algo}; {lora}; {packing}; {sampling}"
