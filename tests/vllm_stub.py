"""A stand-in for ``vllm serve``'s HTTP API, for the server engine's failure cases.

It answers the endpoints unison uses with canned but well-formed responses: completions of
random tokens with made-up log-probs, prompt log-probs that change on every reload (or never,
``frozen_probe``; or no more after reload ``probe_frozen_after``), and it can hang (``hang_after``)
or fail (``fail_after``) once a number of completion requests have been served.

Like vLLM it pauses (``/pause?mode=wait|keep|abort``): a completion that arrives or is being
generated (``completion_delay`` seconds) while it is paused waits for ``/resume``; ``abort`` ends
those being generated at once with finish reason ``abort`` and the tokens sampled so far (their
log-probs say which weights sampled them: −2 − 0.01 · the reloads done). Reloads can be slow
(``reload_delay``) or fail (``fail_reloads``: their 1-based numbers answer 500), a pause can take a
while to return (``pause_delay``, effective at once), and ``gen_log`` / ``segments`` record for every
completion the reloads done when it started and when it ended (the weights it was really generated with).

Tests order themselves on what the server did, never on how long something takes (a busy machine
stretches every delay): ``event(name)`` is set once the server has done ``name`` — ``"completion"`` (a
request arrived), ``"generating"`` (it is being generated: it arrived unpaused or was resumed),
``"pause:wait"`` / ``"pause:keep"`` / ``"pause:abort"``, ``"reload"`` (a weight reload began),
``"resume"``. ``hold_completions`` / ``hold_reloads`` (events the test sets) keep every completion /
reload from finishing until they are set, in place of a delay long enough to act within.
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    def __init__(self, model_root: str, probe_tokens: list[int], vocab: int, *, frozen_probe: bool = False,
                 hang_after: int | None = None, fail_after: int | None = None, dev_mode: bool = True,
                 reload_delay: float = 0.0, server_info: dict | None = None, probe_frozen_after: int | None = None,
                 completion_delay: float = 0.0, fail_reloads=(), pause_delay: float = 0.0, script=None,
                 hold_completions: threading.Event | None = None, hold_reloads: threading.Event | None = None,
                 abort_tokens: int = 2, prompt_logprobs_fn=None):
        self.model_root, self.probe_tokens, self.vocab = model_root, probe_tokens, vocab
        self.frozen_probe, self.hang_after, self.fail_after = frozen_probe, hang_after, fail_after
        self.dev_mode = dev_mode  # VLLM_SERVER_DEV_MODE=1: pause/resume and collective_rpc exist
        self.reload_delay = reload_delay  # seconds a weight reload takes
        self.probe_frozen_after, self.completion_delay = probe_frozen_after, completion_delay
        self.fail_reloads, self.pause_delay = set(fail_reloads), pause_delay
        self.hold_completions, self.hold_reloads = hold_completions, hold_reloads
        self.abort_tokens = abort_tokens  # the tokens an aborted completion had sampled (at most max_tokens − 1)
        #: ``fn(prompt ids) -> log-prob of every token after the first``: a served model's prompt log-probs (a
        #: distillation teacher); None: the sync probe's constant answer
        self.prompt_logprobs_fn = prompt_logprobs_fn
        self.prompt_logprob_requests = 0
        self._events: dict[str, threading.Event] = {}
        self.paused = False
        self.resumed = threading.Condition()
        self.aborts = 0  # /pause?mode=abort calls: completions in flight then end with "abort"
        self.abort_reloads: list[int] = []  # the reloads done when each abort came (what its requests ran under)
        self.reload_paths: list[str] = []
        self.gen_log: list[tuple[int, int, int]] = []  # (seed, reloads at the start, reloads at the end)
        #: every completion as (prompt ids, reloads at its start, at its end, aborted): a continuation's prompt
        #: is the original one and the tokens sampled before the abort
        self.segments: list[tuple[list[int], int, int, bool]] = []
        self.server_info = server_info or {"vllm_config": {"model_config": {"quantization": None},
                                                           "weight_transfer_config": None}}
        self.pause_modes: list[str] = []
        #: ``script(prompt_ids) -> token ids``: answer completions with these (finish "stop", log-prob −0.5 each)
        #: instead of random tokens; every prompt served is kept in ``prompts``
        self.script = script
        self.prompts: list[list[int]] = []
        self.completions = 0
        self.started = 0  # completions that went into generation (arrived, and the server not paused)
        self.reloads = 0
        self.calls: list[str] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj=None):
                body = json.dumps(obj if obj is not None else {}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                stub.calls.append(f"GET {path}")
                if path == "/health":
                    return self._send(200)
                if path == "/v1/models":
                    return self._send(200, {"data": [{"id": "stub", "root": stub.model_root, "max_model_len": 1024}]})
                if path == "/is_paused" and stub.dev_mode:
                    return self._send(200, {"is_paused": False})
                if path == "/server_info" and stub.dev_mode:
                    return self._send(200, stub.server_info)
                if path == "/get_world_size" and stub.dev_mode:
                    return self._send(200, {"world_size": 1})
                return self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                path = self.path.split("?")[0]
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                stub.calls.append(f"POST {path}")
                if path == "/tokenize":
                    return self._send(200, {"tokens": stub.probe_tokens, "count": len(stub.probe_tokens)})
                if path == "/pause":
                    from urllib.parse import parse_qs, urlparse

                    mode = parse_qs(urlparse(self.path).query).get("mode", ["abort"])[0]
                    stub.pause_modes.append(mode)
                    with stub.resumed:
                        stub.paused = True
                        if mode == "abort":
                            stub.aborts += 1
                            stub.abort_reloads.append(stub.reloads)
                        stub.resumed.notify_all()
                    stub.event(f"pause:{mode}").set()
                    time.sleep(stub.pause_delay)
                    return self._send(200, {"status": "ok"})
                if path == "/resume":
                    with stub.resumed:
                        stub.paused = False
                        stub.resumed.notify_all()
                    stub.event("resume").set()
                    return self._send(200, {"status": "ok"})
                if path == "/reset_prefix_cache":
                    return self._send(200, {"success": True})
                if path == "/collective_rpc":
                    stub.event("reload").set()
                    time.sleep(stub.reload_delay)
                    if stub.hold_reloads is not None:
                        assert stub.hold_reloads.wait(120), "the test never released the reload"
                    if stub.reloads + 1 in stub.fail_reloads:
                        stub.fail_reloads.discard(stub.reloads + 1)
                        return self._send(500, {"detail": "reload failed half-way"})
                    stub.reloads += 1
                    stub.reload_paths.append(body.get("kwargs", {}).get("weights_path", ""))
                    return self._send(200, {"results": [None]})
                if path == "/v1/completions":
                    return self._completion(body)
                return self._send(404, {"detail": "Not Found"})

            def _completion(self, body):
                prompt = body["prompt"]
                if body.get("prompt_logprobs") is not None and stub.prompt_logprobs_fn is not None:
                    with stub.lock:
                        stub.prompt_logprob_requests += 1
                    lps = stub.prompt_logprobs_fn(list(prompt))
                    plp = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(prompt[1:], lps)]
                    return self._send(200, {"choices": [{"index": 0, "token_ids": [0], "prompt_logprobs": plp,
                                                         "finish_reason": "length"}]})
                if body.get("prompt_logprobs") is not None:  # the probe after a sync
                    shift = 0 if stub.frozen_probe else stub.reloads
                    if stub.probe_frozen_after is not None:
                        shift = min(shift, stub.probe_frozen_after)
                    plp = [None] + [{str(t): {"logprob": -1.0 - 0.01 * shift}} for t in prompt[1:]]
                    return self._send(200, {"choices": [{"index": 0, "token_ids": [0], "prompt_logprobs": plp,
                                                         "logprobs": {"token_logprobs": [-1.0]},
                                                         "finish_reason": "length"}]})
                with stub.lock:
                    stub.completions += 1
                    count = stub.completions
                if stub.hang_after is not None and count > stub.hang_after:
                    time.sleep(30)
                if stub.fail_after is not None and count > stub.fail_after:
                    return self._send(503, {"detail": "engine dead"})
                stub.prompts.append(list(prompt))
                stub.event("completion").set()
                if stub.script is not None:
                    toks = list(stub.script(list(prompt)))
                    return self._send(200, {"choices": [{"index": i, "token_ids": toks, "finish_reason": "stop",
                                                         "logprobs": {"token_logprobs": [-0.5] * len(toks)}}
                                                        for i in range(body.get("n", 1))]})
                start, aborts = stub._wait_unpaused()  # a request that arrives paused waits for /resume
                stub.event("generating").set()
                aborted, end = stub._generate(stub.completion_delay, aborts)
                stub.gen_log.append((body.get("seed", 0), start, end))
                stub.segments.append((list(prompt), start, end, aborted))
                rng = random.Random(body.get("seed", 0))
                choices = []
                for i in range(body.get("n", 1)):
                    # aborted: the tokens sampled so far (``abort_tokens``, fewer than asked for); else 1..max_tokens
                    k = min(stub.abort_tokens, body["max_tokens"] - 1) if aborted else rng.randint(1, body["max_tokens"])
                    toks = [rng.randrange(4, stub.vocab) for _ in range(k)]
                    choices.append({"index": i, "token_ids": toks, "finish_reason": "abort" if aborted else "length",
                                    "logprobs": {"token_logprobs": [-2.0 - 0.01 * start] * len(toks)}})
                return self._send(200, {"choices": choices})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def event(self, name: str) -> threading.Event:
        """Set once the server has done ``name`` (the module's docstring lists them); ``clear()`` it to
        wait for the next time."""
        with self.lock:
            return self._events.setdefault(name, threading.Event())

    def _generate(self, seconds: float, aborts: int) -> tuple[bool, int]:
        """Spend ``seconds`` generating (and, with ``hold_completions``, until the test sets it), frozen while
        paused and never finishing paused. ``(aborted, the reloads done when it ended)``: aborted as soon as a
        ``pause?mode=abort`` ends it (vLLM answers an aborted request at once, with the tokens sampled so far;
        its end is the abort, whenever this thread notices it — a reload may have begun by then)."""
        left, step, deadline = seconds, 0.01, time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the test never released the completion"
            with self.resumed:
                if self.aborts > aborts:
                    return True, self.abort_reloads[aborts]
                if not self.paused and left <= 0 and (self.hold_completions is None or self.hold_completions.is_set()):
                    return False, self.reloads
                if self.paused:
                    self.resumed.wait(step)
                    continue
            time.sleep(step)
            left -= step

    def _wait_unpaused(self) -> tuple[int, int]:
        """Wait while the server is paused; the reloads and aborts done when it went on (from here on the
        request is being generated: the next abort ends it)."""
        with self.resumed:
            while self.paused:
                self.resumed.wait()
            self.started += 1
            return self.reloads, self.aborts

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
