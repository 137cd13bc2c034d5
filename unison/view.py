"""``unison view RUN_DIR | PROBE_DIR``: the mismatch token by token, as one self-contained HTML page.

A run records, every step (``log.tokens``: up to that many responses, those of largest mismatch; 0 = off), each
sampled token's id and text, log μ (the engine's), log π_old (the learner's, where the step knows it exactly), the
policy version that sampled it, the correction's weight (0: masked) and, on ledger steps, each ledger term's share of
its log-ratio — ``tokens/step_NNNNNN.json``. Older steps are thinned as the run goes on (the last
``log.tokens_recent`` steps kept whole, every ``log.tokens_thin``-th before them): 32–50 bytes a token (measured), so a
1,000-step run of 32 recorded 512-token responses keeps 190 steps, ≈ 125 MB. ``unison probe`` records its arms the same way (``tokens.json``).

The page (``view.html``, written into the directory and printed): for a chosen step (or probe arm) — by default the
last, with a button for the one of largest token k3 — every recorded response as text, each token coloured by
log π − log μ on a diverging scale symmetric about 0 (the legend in nats), its figures on hover; filters (only masked
tokens, only tokens with |Δ| above a threshold); the step's summary (k3, the ledger's shares) above. No server, no
network: every script, style and number is inside the file. The URL's fragment sets the view (its index in the
selector, ``view.html#view=3&masked=1&min=0.5``), so a view can be shared or opened as it was.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import torch

from unison.data_io import atomic_write_text
from unison.errors import UnisonError
from unison.mismatch import k3

FOLDER = "tokens"
PAGE = "view.html"


def _num(x: float, digits: int = 4) -> float | None:
    return round(float(x), digits) if math.isfinite(float(x)) else None


def token_records(batch, rows: torch.Tensor, logp_pi: torch.Tensor, weights: torch.Tensor | None, tokenizer,
                  limit: int, rewards=None, terms: dict | None = None) -> tuple[list[dict], int]:
    """The recorded responses of a batch: of the rows where π_old is known (``rows``), the ``limit`` of largest
    per-response k3 (all when fewer), each as its prompt, reward, and per token ``[id, text, log μ, log π_old, version,
    weight]``, with ``terms`` ({term: [B, L] log-ratio}, the ledger's) per token where given. Also how many rows there
    were to choose from."""
    mask = batch.response_mask
    versions = batch.token_versions(0)
    sel = rows.tolist()
    scores = []
    for r in sel:
        m = mask[r:r + 1]
        scores.append(float(k3(logp_pi[r:r + 1], batch.logp_mu[r:r + 1], m)) if float(m.sum()) else 0.0)
    order = sorted(range(len(sel)), key=lambda i: -scores[i])[:limit] if limit < len(sel) else range(len(sel))
    out = []
    for i in sorted(order):
        r = sel[i]
        cols = mask[r].nonzero().squeeze(-1).tolist()
        if not cols:
            continue
        ids = batch.tokens[r, cols].tolist()
        toks = [[tid, tokenizer.decode([tid], skip_special_tokens=False), _num(batch.logp_mu[r, c]),
                 _num(logp_pi[r, c]), int(versions[r, c]), None if weights is None else _num(weights[r, c], 3)]
                for tid, c in zip(ids, cols)]
        first = cols[0]
        prompt_ids = batch.tokens[r, :first][batch.attention_mask[r, :first].bool()].tolist()
        rec = {"row": r, "group": int(batch.group_ids[r]), "k3": _num(scores[i], 6),
               "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=True), "tokens": toks}
        if rewards is not None:
            rec["reward"] = _num(rewards[r], 3)
        if terms:
            rec["ledger"] = {t: [_num(v[r, c], 5) for c in cols] for t, v in terms.items()}
        out.append(rec)
    return out, len(sel)


def summary(metrics: dict) -> dict:
    """What the page shows above a step: its token k3 and k1, the ledger's terms (k3) and its reward."""
    keep = ("mismatch/k3", "mismatch/k1", "reward/mean", "staleness/mean", "correction/masked_fraction")
    out = {k: metrics[k] for k in keep if isinstance(metrics.get(k), (int, float))}
    ledger = {k[len("ledger/"):-len("_k3")]: v for k, v in metrics.items()
              if k.startswith("ledger/") and k.endswith("_k3") and k != "ledger/total_k3" and isinstance(v, float)}
    if ledger:
        out["ledger"] = ledger
    return out


def write_step(run_dir: Path, step: int, records: list[dict], of: int, metrics: dict, recent: int = 100,
               thin: int = 10) -> Path:
    """``tokens/step_N.json`` for ``step``; then thin the older ones (outside the last ``recent`` steps only every
    ``thin``-th is kept)."""
    folder = Path(run_dir) / FOLDER
    folder.mkdir(exist_ok=True)
    path = atomic_write_text(folder / f"step_{step:06d}.json",
                             json.dumps({"step": step, "of": of, "summary": summary(metrics), "responses": records},
                                        separators=(",", ":")))
    for old in folder.glob("step_*.json"):
        s = int(old.stem.split("_")[1])
        if s <= step - recent and s % thin:
            old.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------ the page
def _views(directory: Path) -> tuple[str, list[dict]]:
    """(title, views) of a run directory (its recorded steps) or a probe directory (its arms)."""
    folder = directory / FOLDER
    if folder.is_dir() and any(folder.glob("step_*.json")):
        views = []
        for p in sorted(folder.glob("step_*.json")):
            d = json.loads(p.read_text())
            views.append({"key": f"step {d['step']}", "step": d["step"], "of": d.get("of"), "summary": d["summary"],
                          "responses": d["responses"]})
        return f"run {directory.name}", views
    probe = directory / "tokens.json"
    if probe.is_file():
        d = json.loads(probe.read_text())
        return f"probe {directory.name}", [{"key": a["label"], "of": a.get("of"), "summary": a["summary"],
                                           "responses": a["responses"]} for a in d["arms"]]
    raise UnisonError(f"'{directory}' holds no token records (tokens/ of a run, tokens.json of a probe): run "
                      f"`unison train` with log.tokens > 0 (the default) or `unison probe`, then view its --out")


def render(directory: str | Path) -> Path:
    """Write ``view.html`` into ``directory`` (a run's or a probe's) and return its path."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UnisonError(f"'{directory}' is not a directory: give a run's --out (unison train) or a probe's")
    title, views = _views(directory)
    k3s = [v["summary"].get("mismatch/k3", -1.0) for v in views]
    data = {"title": title, "views": views, "default": len(views) - 1,
            "worst": max(range(len(views)), key=lambda i: k3s[i])}
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    page = _TEMPLATE.replace("__TITLE__", html.escape(title)).replace("__DATA__", blob)
    return atomic_write_text(directory / PAGE, page)


_TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>unison view — __TITLE__</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.2em 2em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .4em; }
#bar { display: flex; gap: 1.2em; align-items: center; flex-wrap: wrap; margin-bottom: .6em; }
#summary { background: #f5f5f5; padding: .5em .8em; border-radius: 4px; margin-bottom: .6em; }
#legend { display: flex; align-items: center; gap: .4em; font-size: 12px; }
#scale { width: 220px; height: 12px; border: 1px solid #999; }
.resp { border-top: 1px solid #ddd; padding: .5em 0; }
.head { color: #555; font-size: 12px; margin-bottom: .2em; }
.prompt { color: #777; font-family: ui-monospace, monospace; white-space: pre-wrap; }
.text { font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.tok { border-radius: 2px; cursor: default; }
.tok.off { opacity: .12; }
.tok.masked { outline: 1px solid #000; }
#info { position: fixed; right: 1em; top: 1em; width: 300px; background: #fffbe6; border: 1px solid #cca;
        padding: .5em .7em; font-size: 12px; white-space: pre; display: none; }
</style></head><body>
<h1>unison view — __TITLE__</h1>
<div id="bar">
  <label>view <select id="step"></select></label>
  <button id="worst" type="button">largest k3</button>
  <label><input type="checkbox" id="masked"> only masked tokens</label>
  <label>only |Δ| ≥ <input type="number" id="min" step="0.01" min="0" value="0" style="width:5em"> nats</label>
  <span id="legend">log π − log μ: <span id="lo"></span><canvas id="scale" width="220" height="12"></canvas><span id="hi"></span></span>
  <span id="shown"></span>
</div>
<div id="summary"></div>
<div id="responses"></div>
<div id="info"></div>
<script>
const DATA = __DATA__;
const $ = (id) => document.getElementById(id);
function color(d, s) {  // diverging, symmetric about 0: blue where π < μ, red where π > μ
  const t = Math.max(-1, Math.min(1, d / s));
  const a = Math.abs(t);
  const [r, g, b] = t >= 0 ? [255, 255 - 175 * a, 255 - 175 * a] : [255 - 175 * a, 255 - 120 * a, 255];
  return `rgb(${Math.round(r)},${Math.round(g)},${Math.round(b)})`;
}
function scaleOf(view) {  // the 99th percentile of |Δ| over the view's tokens, at least 1e-6 nats
  const ds = [];
  for (const r of view.responses) for (const t of r.tokens) if (t[3] !== null) ds.push(Math.abs(t[3] - t[2]));
  ds.sort((a, b) => a - b);
  return Math.max(ds.length ? ds[Math.floor(0.99 * (ds.length - 1))] : 0, 1e-6);
}
function fmt(x) { return x === null || x === undefined ? "–" : (Math.abs(x) >= 1e-3 || x === 0 ? x.toFixed(4) : x.toExponential(2)); }
function drawLegend(s) {
  const c = $("scale").getContext("2d");
  for (let i = 0; i < 220; i++) { c.fillStyle = color((i / 219 * 2 - 1) * s, s); c.fillRect(i, 0, 1, 12); }
  $("lo").textContent = (-s).toPrecision(2); $("hi").textContent = "+" + s.toPrecision(2);
}
function showSummary(v) {
  const s = v.summary, parts = [`<b>${v.key}</b>`];
  if (s["mismatch/k3"] !== undefined) parts.push(`token k3 ${fmt(s["mismatch/k3"])}`);
  if (s["mismatch/k1"] !== undefined) parts.push(`k1 ${fmt(s["mismatch/k1"])}`);
  if (s["reward/mean"] !== undefined) parts.push(`reward ${fmt(s["reward/mean"])}`);
  if (s["staleness/mean"] !== undefined) parts.push(`staleness ${fmt(s["staleness/mean"])}`);
  if (s.ledger) {
    const tot = Object.values(s.ledger).reduce((a, b) => a + Math.max(b, 0), 0) || 1;
    parts.push("ledger: " + Object.entries(s.ledger).map(([t, x]) => `${t} ${Math.round(100 * Math.max(x, 0) / tot)}%`).join(" | "));
  }
  if (v.of !== undefined && v.of !== null) parts.push(`${v.responses.length} of ${v.of} responses (largest k3 first kept)`);
  $("summary").innerHTML = parts.join(" · ");
}
function render() {
  const v = DATA.views[+$("step").value], s = scaleOf(v);
  drawLegend(s); showSummary(v);
  const box = $("responses"); box.textContent = "";
  for (const r of v.responses) {
    const div = document.createElement("div"); div.className = "resp";
    const head = document.createElement("div"); head.className = "head";
    head.textContent = `row ${r.row} · group ${r.group}` + (r.reward !== undefined ? ` · reward ${r.reward}` : "") + ` · k3 ${fmt(r.k3)}`;
    const prompt = document.createElement("div"); prompt.className = "prompt"; prompt.textContent = r.prompt;
    const text = document.createElement("div"); text.className = "text";
    r.tokens.forEach((t, i) => {
      const [id, piece, mu, pi, ver, w] = t, d = pi === null ? null : pi - mu;
      const span = document.createElement("span"); span.className = "tok"; span.textContent = piece;
      Object.assign(span.dataset, {id: id, mu: mu, pi: pi === null ? "" : pi, d: d === null ? "" : d.toFixed(6), v: ver, w: w === null ? "" : w});
      if (d !== null) span.style.background = color(d, s);
      if (w === 0) span.classList.add("masked");
      let tip = `token ${id} ${JSON.stringify(piece)}\nlog μ ${fmt(mu)}\nlog π ${fmt(pi)}\nΔ ${fmt(d)}\nversion ${ver}\nweight ${w === null ? "–" : w}${w === 0 ? " (masked)" : ""}`;
      if (r.ledger) tip += "\n" + Object.entries(r.ledger).map(([term, xs]) => `${term} ${fmt(xs[i])}`).join("\n");
      span.title = tip;
      span.addEventListener("mouseenter", () => { $("info").style.display = "block"; $("info").textContent = tip; });
      text.appendChild(span);
    });
    div.append(head, prompt, text); box.appendChild(div);
  }
  filter();
}
function filter() {
  const onlyMasked = $("masked").checked, min = +$("min").value || 0;
  let shown = 0, all = 0;
  for (const span of document.querySelectorAll(".tok")) {
    const d = span.dataset.d === "" ? null : Math.abs(+span.dataset.d);
    const keep = (!onlyMasked || span.dataset.w === "0") && (min === 0 || (d !== null && d >= min));
    span.classList.toggle("off", !keep); all++; if (keep) shown++;
  }
  $("shown").textContent = `${shown} of ${all} tokens shown`;
  history.replaceState(null, "", `#view=${$("step").value}&masked=${onlyMasked ? 1 : 0}&min=${min}`);
}
DATA.views.forEach((v, i) => { const o = document.createElement("option"); o.value = i;
  o.textContent = v.key + (v.summary["mismatch/k3"] !== undefined ? ` (k3 ${fmt(v.summary["mismatch/k3"])})` : ""); $("step").appendChild(o); });
const want = Object.fromEntries(location.hash.slice(1).split("&").filter(Boolean).map((kv) => kv.split("=")));
$("step").value = want.view !== undefined && DATA.views[+want.view] ? want.view : DATA.default;
$("masked").checked = want.masked === "1"; $("min").value = want.min || 0;
$("step").addEventListener("change", render); $("masked").addEventListener("change", filter);
$("min").addEventListener("input", filter);
$("worst").addEventListener("click", () => { $("step").value = DATA.worst; render(); });
render();
</script></body></html>
"""
