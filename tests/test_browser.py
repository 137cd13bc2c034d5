"""What a person sees, in a real browser (issue 57): Debian's chromium, headless, loads the page ``unison view`` wrote
for a tiny run and the docs site ``make docs`` builds, and the test reads the DOM it rendered (after its scripts ran)
and takes screenshots. The ``browser`` group: ``make test-browser`` (in CI, which installs chromium with apt-get);
without chromium every test here skips with the line that says how to run it."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.browser, pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: `apt-get install chromium`, then `make test-browser`")]


def _chromium(tmp_path, *args) -> str:
    """Headless chromium as the machine's probe runs it: no sandbox (root), no background networking, a fresh
    profile; stdout."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    r = subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _dom(tmp_path, url: str) -> str:
    return _chromium(tmp_path, "--virtual-time-budget=3000", "--dump-dom", url)


class Browser:
    """One chromium tab driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages,
    NUL-separated, on fds 3 and 4), for what ``--dump-dom``'s virtual clock cannot wait for (the docs search runs
    in a web worker): open a page, evaluate JavaScript in it, wait in real time; every uncaught exception the page
    threw is kept in ``errors``."""

    def __init__(self, tmp_path):
        chrome_in, self._to = os.pipe()      # chromium reads its commands on fd 3
        self._from, chrome_out = os.pipe()   # and writes its replies on fd 4

        def fds():  # copies first, so that neither end is overwritten if the pipe itself got fd 3 or 4
            read, write = os.dup(chrome_in), os.dup(chrome_out)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", f"--user-data-dir={tmp_path / 'cdp-profile'}",
             "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(chrome_in)
        os.close(chrome_out)
        self._buf, self._id, self.errors = b"", 0, []
        target = self._call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self._call("Runtime.enable", _session=True)

    def _call(self, method, _session=False, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if _session:
            msg["sessionId"] = self._session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + 60
        while True:
            while b"\0" not in self._buf:
                assert time.monotonic() < deadline, f"chromium did not answer {method}"
                chunk = os.read(self._from, 1 << 16)
                assert chunk, "chromium closed the DevTools pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("method") == "Runtime.exceptionThrown":
                self.errors.append(reply["params"]["exceptionDetails"].get("exception", {}).get("description"))
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    def open(self, url: str) -> None:
        self._call("Page.navigate", _session=True, url=url)

    def eval(self, expression: str):
        return self._call("Runtime.evaluate", _session=True, expression=expression, returnByValue=True)[
            "result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0):
        """The expression's value once it is truthy, polling in real time; fails after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"after {timeout:.0f} s the page still gives a false {expression!r}")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._to)
        os.close(self._from)


def _tokens(dom: str) -> list[dict]:
    """Every token span the page rendered: its classes, data attributes, style and hover text."""
    out = []
    for m in re.finditer(r'<span class="(tok[^"]*)"([^>]*)>', dom):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(2)))
        out.append({"classes": m.group(1).split(), **attrs})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run whose correction masks tokens (int4 rollout, IcePop's mask narrowed to [0.9, 1.1]) and whose ledger
    runs every step: 3 steps, every response recorded."""
    from unison.config import load_config
    from unison.trainer import Trainer

    d = tmp_path_factory.mktemp("view")
    (d / "r.py").write_text("def reward(response, item):\n    return len(response) / 10\n")
    cfg = load_config(None, ["task.digits=1", "task.train_size=40", "task.eval_size=0", "rollout.n=4",
                             "rollout.max_new_tokens=8", "train.prompts_per_step=4", "train.steps=3",
                             "train.lr=1e-2", "log.console=false", "log.tensorboard=false", "algo=grpo_icepop",
                             "policy.correction_c_low=0.9", "policy.correction_c=1.1",
                             "rollout.quantization=int4", "rollout.quant_group_size=32", "mismatch.decompose_every=1",
                             f"task.reward={d / 'r.py'}:reward", "task.truncated_reward=null", "log.tokens=64"])
    Trainer(cfg, d / "run", log=lambda m: None).fit()
    return d / "run"


def test_the_viewer_shows_every_token_coloured_with_the_runs_own_numbers(run, tmp_path):
    from unison.cli import main
    from unison.data_io import read_metrics

    assert main(["view", str(run)]) == 0
    page = run / "view.html"
    text = page.read_text()
    assert "<script src" not in text and "http://" not in text and "https://" not in text  # self-contained
    dom = _dom(tmp_path, page.as_uri())
    toks = _tokens(dom)
    rows = read_metrics(run / "metrics.jsonl")
    last = json.loads((run / "tokens" / "step_000003.json").read_text())
    assert len(toks) == sum(len(r["tokens"]) for r in last["responses"]) > 0  # the last step, every token
    assert all("background: rgb(" in t.get("style", "") for t in toks)  # coloured by log π − log μ
    # the hover data are the run's numbers: over every response of the step, mean(log μ − log π) is its k1
    mu = [float(t["data-mu"]) for t in toks]
    pi = [float(t["data-pi"]) for t in toks]
    assert sum(m - p for m, p in zip(mu, pi)) / len(mu) == pytest.approx(rows[-1]["mismatch/k1"], abs=2e-4)
    first = toks[0]
    assert f"log μ {float(first['data-mu']):.4f}" in first["title"].replace("&amp;", "&")
    assert "version" in first["title"] and "quantization" in first["title"]  # the ledger's terms, per token
    assert "token k3" in dom and "ledger:" in dom and f"{len(last['responses'])} of {last['of']}" in dom
    shot = tmp_path / "view.png"
    _chromium(tmp_path, "--window-size=1300,900", f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 20_000


def test_the_viewers_filters_hide_what_they_should(run, tmp_path):
    from unison.view import render

    page = render(run)
    last = len(list((run / "tokens").glob("step_*.json"))) - 1
    toks = _tokens(_dom(tmp_path, page.as_uri() + f"#view={last}&masked=1&min=0"))
    masked = [t for t in toks if t["data-w"] == "0"]
    assert masked and len(masked) < len(toks)  # IcePop masked some tokens of the int4 rollout, not all
    assert all(("off" in t["classes"]) == (t["data-w"] != "0") for t in toks)
    assert all("masked" in t["classes"] for t in masked)
    toks = _tokens(_dom(tmp_path, page.as_uri() + f"#view={last}&masked=0&min=0.5"))
    for t in toks:
        assert ("off" in t["classes"]) == (abs(float(t["data-d"])) < 0.5)
    assert any("off" in t["classes"] for t in toks) and any("off" not in t["classes"] for t in toks)


def test_the_viewers_controls_answer_a_click(run, tmp_path):
    """As a person uses it: tick "only masked tokens", pick a step, press "largest k3"; no script error."""
    from unison.view import render

    page = render(run)
    browser = Browser(tmp_path)
    try:
        browser.open(page.as_uri())
        total = browser.wait_for("document.querySelectorAll('.tok').length")
        browser.eval("document.getElementById('masked').click()")
        shown = browser.eval("document.getElementById('shown').textContent")
        masked = browser.eval("document.querySelectorAll('.tok.masked').length")
        assert shown == f"{masked} of {total} tokens shown" and 0 < masked < total
        assert browser.eval("location.hash").endswith("masked=1&min=0")
        browser.eval("const s = document.getElementById('step'); s.value = '0'; s.dispatchEvent(new Event('change'))")
        assert browser.eval("document.getElementById('summary').textContent").startswith("step 1")
        browser.eval("document.getElementById('worst').click()")
        worst = browser.eval("DATA.views[DATA.worst].key")
        assert browser.eval("document.getElementById('summary').textContent").startswith(worst)
        assert not browser.errors, browser.errors
    finally:
        browser.close()


def test_the_probes_viewer_page_shows_its_arms(tmp_path):
    from unison.probe import ProbeConfig, run_probe
    from unison.probe_tables import write_outputs

    out = run_probe(ProbeConfig(precisions=["fp32", "bf16"], n=2, max_new_tokens=12, ledger=True), log=lambda m: None)
    write_outputs(out, tmp_path / "probe")
    dom = _dom(tmp_path, (tmp_path / "probe" / "view.html").as_uri())
    assert "native/fp32" in dom and "native/bf16" in dom and "ledger:" in dom
    assert _tokens(dom)


# ------------------------------------------------------------------ the docs site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed: `make docs` installs it (the docs extra)")
    r = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield out, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_docs_site_renders_searches_and_has_no_broken_link(site, tmp_path):
    out, url = site
    home = _dom(tmp_path, url + "/")
    assert "trainer and the sampler agree" in home and "demo.md" not in re.sub(r"<code>.*?</code>", "", home)
    ref = _dom(tmp_path, url + "/config/")
    assert "train.lr" in ref or "<code>lr</code>" in ref
    browser = Browser(tmp_path)
    try:  # the search box's results, as the theme's worker fills them for ?q=
        browser.open(url + "/?q=ledger")
        hits = browser.wait_for("document.querySelectorAll('#mkdocs-search-results article a').length "
                                "&& [...document.querySelectorAll('#mkdocs-search-results article a')]"
                                ".map(a => a.textContent)")
        assert "The mismatch ledger" in hits
        for page in ("", "config/", "ledger/", "experiments/smollm2/"):  # pages load without a script error
            browser.open(url + "/" + page)
            browser.wait_for("document.readyState === 'complete'")
        assert not browser.errors, browser.errors
    finally:
        browser.close()
    broken = []
    for page in out.rglob("*.html"):
        for href in re.findall(r'href="([^"#?]+)[^"]*"', page.read_text(encoding="utf-8", errors="replace")):
            if re.match(r"^[a-z]+:", href) or href.startswith("/"):
                continue
            target = (page.parent / href).resolve()
            if not (target.exists() or (target / "index.html").exists()):
                broken.append(f"{page.relative_to(out)} -> {href}")
    assert not broken, broken[:10]
    shot = tmp_path / "home.png"
    _chromium(tmp_path, "--window-size=1200,900", f"--screenshot={shot}", url + "/")
    assert shot.stat().st_size > 20_000
