"""Everything ``unison train`` checks before the run directory is touched.

Each function raises :class:`~unison.errors.UnisonError` with one line naming the culprit and
the fix; none writes anything. The trainer calls them in order at start-up.
"""

from __future__ import annotations

from pathlib import Path

from unison import checkpoint as ckpt
from unison.algorithms.losses import PER_TOKEN_ADVANTAGES
from unison.algorithms.presets import resolve_policy
from unison.compilation import check as check_compile
from unison.config import Config, dump_config
from unison.config import PATH_KEYS
from unison.data_io import read_metrics
from unison.distributed import under_torchrun
from unison.errors import UnisonError
from unison.exact import check_supported
from unison.kvcache import check_model as check_kv_cache_model
from unison.models import check_state_dtype, model_config
from unison.precision import Precision
from unison.tasks.env import is_multi_turn
from unison.tasks.env import tokens_after_prompt


def _check_distill_settings(cfg: Config) -> None:
    if cfg.algo == "opd" and not cfg.distill.teacher:
        raise UnisonError("algo=opd distills from a teacher but distill.teacher is not set: name its model, "
                          "e.g. --set distill.teacher=runs/demo/sft/model")
    if cfg.distill.teacher_url and not cfg.distill.teacher:
        raise UnisonError("distill.teacher_url is set but distill.teacher is not: name the served teacher's local copy "
                          "too (its tokenizer is checked against the student's, and the ledger compares the two paths)")
    if not cfg.distill.teacher:
        return
    if cfg.distill.teacher_url and cfg.rollout.temperature != 1.0:
        raise UnisonError(f"distill.teacher_url scores with the server's prompt log-probs, which are the teacher's raw "
                          f"distribution (temperature 1), but rollout.temperature is {cfg.rollout.temperature:g}: set "
                          f"rollout.temperature=1 or drop distill.teacher_url (the local scoring pass applies it)")
    if cfg.distill.estimator == "full":  # the teacher's logits over the whole vocabulary, in this process
        why = ("a served teacher (distill.teacher_url) gives the sampled tokens' log-probs, not its logits: drop "
               "distill.teacher_url (the local copy then scores)" if cfg.distill.teacher_url
               else "the teacher's logits are computed in one process (not under torchrun yet): launch without "
               "torchrun" if under_torchrun()
               else "it scores the padded layout: set train.packing=false" if cfg.train.packing
               else "exact mode's shared forward has no teacher: set exact=false" if cfg.exact else None)
        if why:
            raise UnisonError(f"distill.estimator=full cannot run here, {why}, or use distill.estimator=sampled")
    loss = resolve_policy(cfg.algo, cfg.policy)["loss"]
    if loss not in PER_TOKEN_ADVANTAGES:
        raise UnisonError(f"distill.teacher gives every token its own advantage, which policy.loss={loss} cannot take "
                          f"(it weighs a response as a whole): use algo=opd, or a loss among "
                          f"{', '.join(sorted(PER_TOKEN_ADVANTAGES))}")


def check_settings(cfg: Config) -> None:
    """Combinations of keys that cannot run, whatever the data."""
    d = cfg.distributed
    set_keys = [k for k, v in d.model_dump().items() if v is not None]
    if set_keys and not under_torchrun():
        raise UnisonError(f"distributed.{set_keys[0]} is set but unison is not running under torchrun: "
                          f"launch with `torchrun --nproc-per-node N -m unison train ...`, or remove "
                          f"the distributed section")
    check_device(cfg.device)

    check_compile(cfg.compile, cfg.exact, 2 if under_torchrun() else 1, cfg.train.quantization_aware)
    if cfg.train.quantization_aware:
        _check_quantization_aware(cfg)
    if cfg.exact:
        _check_exact_settings(cfg)
    _check_async_settings(cfg)
    _check_distill_settings(cfg)
    _check_kv_cache_settings(cfg)
    if cfg.mismatch.ledger == "on":
        _check_ledger_settings(cfg)
    budget = cfg.train.mismatch_budget.metric or ("mismatch/staleness_k3" if cfg.rollout.max_staleness else None)
    if cfg.train.schedule == "mismatch_budget" and budget == "mismatch/staleness_k3" and \
            (under_torchrun() or not cfg.rollout.max_staleness or (cfg.lora.rank and cfg.train.quantization_aware)
             or cfg.engine != "native"):
        why = ("the run is synchronous: every sample is on-policy" if not cfg.rollout.max_staleness else
               f"its split scores with the older weights that sampled, and engine {cfg.engine} ({cfg.vllm.mode}) keeps "
               f"none: only the native engine's worker does" if cfg.engine != "native" else
               "its split scores with older weights, which FSDP2 shards" if under_torchrun() else
               "its split scores with older merged weights, which the quantization-aware learner with LoRA does not")
        raise UnisonError(f"train.schedule=mismatch_budget watches mismatch/staleness_k3, which this run never logs "
                          f"({why}): set train.mismatch_budget.metric=mismatch/k3")
    if cfg.lora.rank and cfg.lora.dropout:
        anchor = resolve_policy(cfg.algo, cfg.policy)["anchor"]
        if anchor in ("bypass", "loglinear"):
            raise UnisonError(f"policy.anchor={anchor} reads π_old and the measured mismatch from the training forward, "
                              f"which lora.dropout={cfg.lora.dropout:g} makes a random sample: set lora.dropout=0, or "
                              f"policy.anchor=recompute (a score pass without dropout)")
    if cfg.rollout.state_dtype != "fp32" and cfg.engine != "native":
        raise UnisonError(f"rollout.state_dtype={cfg.rollout.state_dtype} rounds the native engine's recurrent state "
                          f"(vLLM keeps its own: its mamba_ssm_cache_dtype): set engine=native, or "
                          f"rollout.state_dtype=fp32")
    truncated = cfg.rollout.top_p < 1.0 or cfg.rollout.top_k
    if truncated and cfg.rollout.replay_sampling_mask and cfg.engine != "native":
        raise UnisonError(f"rollout.replay_sampling_mask needs the support each token was sampled from, which "
                          f"engine '{cfg.engine}' does not return to unison: set rollout.replay_sampling_mask=false "
                          f"(π/μ then carries the log of the top-p/top-k kept mass), or engine=native")


def _check_kv_cache_settings(cfg: Config) -> None:
    """A quantized KV cache (unison/kvcache.py): the native engine outside exact mode; its replay needs one."""
    kv, t = cfg.rollout.kv_cache_dtype, cfg.train
    if kv == "auto":
        if t.kv_cache_aware:
            raise UnisonError("train.kv_cache_aware replays a quantized KV cache, and rollout.kv_cache_dtype is 'auto' "
                              "(none): set rollout.kv_cache_dtype=fp8_e4m3 or fp8_e5m2, or train.kv_cache_aware=false")
        return
    if cfg.engine != "native":
        raise UnisonError(f"rollout.kv_cache_dtype={kv} is the native engine's cache (vLLM's own fp8 cache does not "
                          f"give unison the scales it used, so the learner could not replay it): set engine=native, "
                          f"or rollout.kv_cache_dtype=auto and vLLM's own kv_cache_dtype")
    check_kv_cache_model(kv, None, cfg.exact)  # exact mode: refused before any model config is read
    if t.kv_cache_aware and t.activation_checkpointing:
        raise UnisonError("train.kv_cache_aware quantizes the keys and values in the forward, which "
                          "train.activation_checkpointing's recompute in the backward would not: set one of them false")


def check_device(device: str, flag: str = "device") -> None:
    """A device this torch can use: ``cpu``, or ``cuda``/``cuda:N`` on a CUDA build with that GPU."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise UnisonError(f"{flag} '{device}' is not a torch device: use cpu or cuda (cuda:N)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU is visible"
            raise UnisonError(f"{flag} is '{device}' but CUDA is not available ({why}): set {flag}=cpu, or "
                              f"install the CUDA build of torch for your GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UnisonError(f"{flag} is '{device}' but this machine has {torch.cuda.device_count()} GPU(s): "
                              f"use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise UnisonError(f"{flag} '{device}' is not supported: use cpu or cuda")


def _check_exact_settings(cfg: Config) -> None:
    if is_multi_turn(cfg):
        raise UnisonError(f"exact mode fixes one prompt width and one response per row, and task '{cfg.task.name}' "
                          f"is multi-turn (each turn's prompt grows): set exact=false")
    if cfg.engine != "native":
        raise UnisonError(f"exact mode needs the native engine (engine is '{cfg.engine}'): set engine=native "
                          f"or exact=false")
    if cfg.rollout.top_p < 1.0 or cfg.rollout.top_k:
        raise UnisonError("exact mode samples from the full distribution the learner scores: set "
                          "rollout.top_p=1 and rollout.top_k=0")
    if under_torchrun():
        raise UnisonError("exact mode runs in one process: launch without torchrun, or set exact=false")
    if cfg.lora.rank:
        raise UnisonError("exact mode does not take LoRA adapters yet: set lora.rank=0 or exact=false")
    if cfg.rollout.quantization.startswith("w8a8"):
        raise UnisonError(f"exact mode shares one forward of the weights between the engine and the learner, and "
                          f"rollout.quantization {cfg.rollout.quantization} quantizes activations too, which it does "
                          f"not run: use {cfg.rollout.quantization[5:]} (weight-only) or exact=false")
    if cfg.rollout.quantization != "none" and not cfg.train.quantization_aware:
        raise UnisonError(f"exact mode needs the engine to hold the learner's weights, and "
                          f"rollout.quantization is '{cfg.rollout.quantization}': set train.quantization_aware=true "
                          f"(the learner then computes through the same quantizer), rollout.quantization=none, "
                          f"or exact=false")
    if cfg.rollout.state_dtype != "fp32":
        raise UnisonError(f"exact mode keeps a recurrent state in fp32 on both sides, and rollout.state_dtype is "
                          f"'{cfg.rollout.state_dtype}': set rollout.state_dtype=fp32 or exact=false")
    if cfg.rollout.max_staleness:
        raise UnisonError(f"exact mode needs the engine and the learner to hold equal weights, and "
                          f"rollout.max_staleness={cfg.rollout.max_staleness} samples with older ones: set "
                          f"rollout.max_staleness=0 or exact=false")
    if "cuda" in str(cfg.device):
        raise UnisonError("exact mode is built for CPUs: cuBLAS picks kernels by shape, and no batch-invariant "
                          "GPU route has run yet (docs/exact.md); set device=cpu or exact=false")


def _check_quantization_aware(cfg: Config) -> None:
    if cfg.rollout.quantization == "none":
        raise UnisonError("train.quantization_aware needs a quantized rollout (rollout.quantization is 'none'): set "
                          "rollout.quantization=fp8, int8 or int4, or train.quantization_aware=false")
    if cfg.lora.rank and cfg.lora.dropout:
        raise UnisonError(f"train.quantization_aware with LoRA quantizes the merged weight W + (α/r)·B·A, which "
                          f"leaves no adapter input to drop out (lora.dropout={cfg.lora.dropout}): set lora.dropout=0")
    if cfg.engine != "native":
        raise UnisonError(f"train.quantization_aware computes through unison's own quantizer (unison/quant.py), and "
                          f"engine '{cfg.engine}' quantizes with its own kernels: use engine=native")

    learner = Precision.resolve(cfg.precision, cfg.rollout_precision, cfg.learner_precision).learner
    if cfg.distributed.param_dtype == "compute" and learner != "fp32":
        raise UnisonError(f"train.quantization_aware quantizes the weight FSDP2 gathers, and "
                          f"distributed.param_dtype=compute gathers it in {learner} while the engine quantizes the "
                          f"fp32 masters (other scales and codes: π ≠ μ): set distributed.param_dtype=fp32, the "
                          f"default with train.quantization_aware")


def _check_ledger_settings(cfg: Config) -> None:
    """``mismatch.ledger: on`` promises every term of the chain: refuse a run in which one cannot be measured."""
    fix = "set mismatch.ledger=auto (the term is then merged into its neighbour) or off"
    if cfg.exact:
        raise UnisonError(f"mismatch.ledger=on in exact mode: log μ and log π_old are bitwise equal, there is no term "
                          f"to measure; {fix}")
    if not cfg.mismatch.decompose_every:
        raise UnisonError("mismatch.ledger=on runs every mismatch.decompose_every steps, and that is 0: set "
                          "mismatch.decompose_every ≥ 1, or mismatch.ledger=auto or off")
    if cfg.engine != "native":
        raise UnisonError(f"mismatch.ledger=on needs an engine that re-scores its own samples in a prefill pass (the "
                          f"decode term), and engine '{cfg.engine}' does not for unison: {fix}")
    if cfg.rollout.max_staleness and (under_torchrun() or (cfg.lora.rank and cfg.train.quantization_aware)):
        raise UnisonError(f"mismatch.ledger=on needs the learner to score with older weights for its staleness term, "
                          f"which {'FSDP2 shards' if under_torchrun() else 'the quantization-aware learner with LoRA does not'}"
                          f": {fix}")


def _check_async_settings(cfg: Config) -> None:
    K = cfg.rollout.max_staleness
    if not K:
        return
    if cfg.engine == "vllm" and cfg.vllm.mode != "server":
        raise UnisonError(f"rollout.max_staleness={K} needs the rollout engine beside the learner, and a colocated "
                          f"vLLM shares its device: use vllm.mode=server, engine=native, or max_staleness=0")
    if cfg.engine == "vllm":
        if under_torchrun():
            raise UnisonError(f"rollout.max_staleness={K} with a vLLM server runs in one trainer process: launch "
                              f"without torchrun, or set rollout.max_staleness=0")
        if cfg.vllm.weight_sync == "nccl":
            raise UnisonError(f"rollout.max_staleness={K} with vllm.weight_sync=nccl: the NCCL transfer reads the "
                              f"learner while it trains; use vllm.weight_sync=disk")


def check_data(cfg: Config, task, world_size: int) -> None:
    n = len(task.train)
    if n == 0:
        raise UnisonError("the task has no training prompts: raise task.train_size or check the data")
    if cfg.train.prompts_per_step % world_size:
        raise UnisonError(f"train.prompts_per_step={cfg.train.prompts_per_step} is not divisible by the "
                          f"world size {world_size}: every rank generates whole prompt groups; use a multiple of "
                          f"{world_size}")
    if n < cfg.train.prompts_per_step and cfg.task.name == "math" and not cfg.task.eval_path:
        raise UnisonError(
            f"task.path leaves {n} training prompt(s) after holding out {len(task.eval)} for eval, "
            f"fewer than train.prompts_per_step={cfg.train.prompts_per_step}: lower task.eval_size "
            f"or pass task.eval_path")


def check_context(cfg: Config, model_dir: Path, task, prompt_ids) -> None:
    config = model_config(model_dir)
    check_kv_cache_model(cfg.rollout.kv_cache_dtype, config, cfg.exact)
    check_state_dtype(cfg.rollout.state_dtype, config)
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    need = len(prompt_ids[longest]) + tokens_after_prompt(cfg)
    key = "task.max_episode_tokens" if is_multi_turn(cfg) else "rollout.max_new_tokens"
    if limit is not None and need > limit:
        where = task.train[longest].meta.get("source") or f"training prompt #{longest}"
        raise UnisonError(
            f"{where}: the prompt has {len(prompt_ids[longest])} tokens; with "
            f"{key}={tokens_after_prompt(cfg)} that exceeds the model's "
            f"context of {limit}: lower {key} or drop long prompts")


def exact_layout(cfg: Config, model_dir: Path, task, tokenizer, prompt_ids) -> tuple[int, int]:
    """The model family exact mode needs, and the fixed layout (prompt width, total length) the
    engine's cache and the learner's batches share."""
    check_supported(model_config(model_dir))
    eval_ids = [task.encode(tokenizer, it) for it in task.eval] if cfg.train.eval_every else []
    width = max(len(p) for p in prompt_ids + eval_ids)
    return width, width + cfg.rollout.max_new_tokens


def check_run_dir(run_dir: Path, cfg: Config, resume: bool) -> None:
    """Read-only: refuse an occupied --out without --resume, and a resume of another config
    (naming every key that differs). A directory a run left before its first step (no metrics,
    no checkpoint) may be used again without --resume."""
    import yaml

    d = Path(run_dir)
    cfg_path = d / "config.yaml"
    new_cfg = dump_config(cfg)
    if d.exists() and not d.is_dir():
        raise UnisonError(f"--out '{d}' exists and is not a directory: choose another path")
    occupied = d.exists() and any(d.iterdir()) and not never_started(d)
    if occupied and not resume:
        what = "a run of a different config" if cfg_path.exists() and cfg_path.read_text() != new_cfg \
            else "a run"
        raise UnisonError(f"--out '{d}' already holds {what}: pass --resume to continue it, "
                          f"or choose a new --out")
    if resume and cfg_path.exists():
        try:
            old = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UnisonError(f"--resume: '{cfg_path}' is damaged ({type(e).__name__}): restore it "
                              f"or start a new run") from e
        new = yaml.safe_load(new_cfg)
        for tree in (old, new):  # what a resumed run may change: its length, threads, matmul library, compilation
            tree.get("train", {}).pop("steps", None)
            for key in ("threads", "gemm", "compile"):
                tree.pop(key, None)
        # a run written by an older unison lacks the newer keys: they take this config's values
        diffs = [d for d in differences(old, new) if (d[1] is not None or _has(old, d[0])) and not _same_path(*d)]
        if diffs:
            shown = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in diffs[:8])
            more = f" and {len(diffs) - 8} more" if len(diffs) > 8 else ""
            raise UnisonError(f"--resume: the config differs from the run's config.yaml at {shown}{more}: resume "
                              f"with the same config (only train.steps and threads may change; `unison train --out "
                              f"{d} --resume` without a config reads the run's own)")


def never_started(d: Path) -> bool:
    """A run directory a run left before finishing its first step: nothing in it is worth keeping."""
    metrics = d / "metrics.jsonl"
    try:
        has_steps = metrics.exists() and bool(read_metrics(metrics))
    except UnisonError:
        has_steps = True  # damaged: someone should look at it
    return (d / "config.yaml").exists() and not has_steps and not ckpt.complete(d / "checkpoints")


def _same_path(key: str, old, new) -> bool:
    """A run written before paths were saved absolute: its relative path, read from here, is the new one."""
    if key not in (*PATH_KEYS, "task.reward") or not isinstance(old, str) or not isinstance(new, str):
        return False
    return Path(old.rsplit(":", 1)[0] if key == "task.reward" else old).resolve() == \
        Path(new.rsplit(":", 1)[0] if key == "task.reward" else new).resolve()


def _has(tree: dict, dotted: str) -> bool:
    node = tree
    for k in dotted.split("."):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


def differences(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    """Every leaf key where two nested dicts differ: ``(key, a's value, b's value)``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]
