"""What ``unison probe`` writes and prints: ``probe.json`` and the plots (:func:`write_outputs`), the console tables
of the arms' mismatch (:func:`format_table`) and of their ledgers (:func:`format_ledger`)."""

from __future__ import annotations

import json
from pathlib import Path

from unison.data_io import atomic_write_text
from unison.ledger import TERMS
from unison.locate import locate_markdown
from unison.plots import probe_plots
from unison.view import render as render_view


def write_outputs(out: dict, out_dir: Path) -> list[Path]:
    """Write ``probe.json`` (atomically), the plots, and the token records with their page (``tokens.json``,
    ``view.html``: ``unison view``) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"results": out["results"], "config": out["config"]}
    written = [atomic_write_text(out_dir / "probe.json", json.dumps(payload, indent=2) + "\n")]
    if out.get("tokens"):
        written.append(atomic_write_text(out_dir / "tokens.json", json.dumps({"arms": out["tokens"]},
                                                                             separators=(",", ":"))))
        written.append(render_view(out_dir))
    if any(r.get("locate") for r in out["results"]):
        written.append(atomic_write_text(out_dir / "locate.md", locate_markdown(out["results"])))
    written += probe_plots(out["results"], out["samples"], out_dir / "plots")
    return written


def precision_ratios(results: list[dict], engines: list[str], param_dtype: str) -> list[str]:
    """Paper A's comparison per engine: bf16's mismatch over fp16's (token k3, sequence KL), on the plain arms."""
    by = {(r["engine"], r["precision"]): r for r in results
          if r["param_dtype"] == param_dtype and not r["exact"] and r["quantization"] == "none"
          and r["top_p"] == 1.0 and not r["top_k"]}
    out = []
    for eng in engines:
        bf, fp = by.get((eng, "bf16")), by.get((eng, "fp16"))
        if bf and fp:
            rk, rs, rs3 = (ratio(bf[k], fp[k]) for k in ("mismatch/k3", "mismatch/seq_kl", "mismatch/seq_kl_k3"))
            out.append(f"{eng}: bf16/fp16 ratio of token k3 = {_fmt(rk)}, of seq KL = {_fmt(rs)}, "
                       f"of seq KL (k3 sum) = {_fmt(rs3)}")
    return out


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.1f}x"


def ratio(a: float, b: float) -> float | None:
    return a / b if b not in (0, 0.0) else None


def exact_failed(result: dict) -> bool:
    """An exact-mode row whose log π and log μ are not bitwise equal on every token: a failure, not a result."""
    return bool(result.get("exact")) and result.get("mismatch/identical_fraction", 1.0) < 1.0


def format_ledger(results: list[dict]):
    """A rich Table of each arm's mismatch ledger: every term's k3 and its share of the sum."""
    from rich.table import Table

    rows = [r for r in results if "ledger/total_k1" in r]
    terms = [t for t in TERMS if any(f"ledger/{t}_k3" in r for r in rows)]
    table = Table(title="mismatch ledger: k3 of each step of the chain log μ → log π (share of Σk3)")
    compiled = any(r.get("compile", "off") != "off" for r in rows)  # the arm columns the main table shows too
    lora = any(r.get("lora_rank") for r in rows)
    arm = ["engine", "precision", "weights", "top-p/k", *(["compiled"] if compiled else []), *(["LoRA r"] if lora else [])]
    for name in (*arm, *terms, "total k3", "Σ k1 = total k1"):
        table.add_column(name, justify="left" if name in arm else "right")
    for r in rows:
        vals = [r.get(f"ledger/{t}_k3") for t in terms]
        total = sum(max(v or 0.0, 0.0) for v in vals) or 1.0
        cells = ["–" if v is None else f"{v:.2g} ({100 * max(v, 0.0) / total:.0f}%)" for v in vals]
        s1 = sum(r.get(f"ledger/{t}_k1", 0.0) for t in terms)
        trunc = "/".join(x for x in (f"p {r['top_p']:g}" if r.get("top_p", 1.0) < 1 else "",
                                     f"k {r['top_k']}" if r.get("top_k") else "") if x) or "–"
        kv = r.get("kv_cache", "auto")
        weights = r.get("quantization", "none") + ("" if kv == "auto" else f", KV {kv}")
        table.add_row(r["engine"], r["precision"], weights, trunc,
                      *([r.get("compile", "off")] if compiled else []), *([str(r.get("lora_rank", 0))] if lora else []),
                      *cells,
                      f"{r['ledger/total_k3']:.3g}", f"{s1:.3g} = {r['ledger/total_k1']:.3g}")
    return table


def format_table(results: list[dict], timings: list[dict] | None = None):
    """A rich Table of the main metrics per arm."""
    from rich.table import Table

    table = Table(title="training–inference mismatch (μ = rollout engine, π = learner)")
    cols = [("engine", "engine"), ("precision", "precision")]
    if len({r.get("param_dtype") for r in results}) > 1:
        cols.append(("params", "param_dtype"))
    if any(r.get("exact") for r in results):
        cols.append(("exact", "exact"))
    quantized = any(r.get("quantization", "none") != "none" for r in results)
    if quantized:
        cols.append(("weights", "quantization"))
    if any(r.get("kv_cache", "auto") != "auto" for r in results):
        cols.append(("KV cache", "kv_cache"))
    if any(r.get("quantization_aware") for r in results):
        cols.append(("QAT", "quantization_aware"))
    if any(r.get("top_p", 1.0) < 1.0 for r in results):
        cols.append(("top-p", "top_p"))
    if any(r.get("top_k") for r in results):
        cols.append(("top-k", "top_k"))
    if any(r.get("replay_sampling_mask") for r in results):
        cols.append(("replay", "replay_sampling_mask"))
    if any(r.get("compile", "off") != "off" for r in results):
        cols.append(("compiled", "compile"))
    if any(r.get("lora_rank") for r in results):
        cols.append(("LoRA r", "lora_rank"))
    cols += [("tokens", "mismatch/num_tokens"),
             ("mean len", "mean_response_length"), ("token k3", "mismatch/k3"),
             ("seq KL", "mismatch/seq_kl"), ("seq KL (k3)", "mismatch/seq_kl_k3"), ("mean |π−μ|", "mismatch/prob_diff_mean"),
             ("max |π−μ|", "mismatch/prob_diff_max"), ("slope/1K", "seq_log_ratio_slope_per_1k")]
    if quantized:  # what a correction would do: token TIS/MIS clip fraction, seq-MIS drop fraction
        cols += [("ρ∉[½,2]", "mismatch/token_rho_outside_fraction"), ("seq ρ>10", "mismatch/seq_rho_over_c_fraction")]
    if any("mismatch/retokenize_k3" in r for r in results):  # --task: episodes and the re-tokenizing loop's drift
        cols += [("turns", "rollout/turns_mean"), ("retok. turns", "mismatch/retokenize_fraction"),
                 ("k3 if re-tokenized", "mismatch/retokenize_k3")]
    if any("mismatch/router_disagreement" in r for r in results):  # MoE
        cols += [("router disagr.", "mismatch/router_disagreement"), ("k3 (replay)", "mismatch/k3_routing_replay")]
    for name, _ in cols:
        table.add_column(name, justify="left" if name in ("engine", "precision", "params", "weights") else "right")
    if timings:
        table.add_column("tok/s", justify="right")
        table.add_column("peak RSS GiB", justify="right")
    for i, r in enumerate(results):
        row = []
        for _, key in cols:
            v = r.get(key)
            if key == "exact" and exact_failed(r):
                row.append(f"[bold red]FAILED ({r['mismatch/identical_fraction']:.2f} identical)[/]")
            elif isinstance(v, bool):
                row.append("yes" if v else "no")
            elif isinstance(v, str):
                row.append(v)
            elif v is None:
                row.append("–")
            elif isinstance(v, int):
                row.append(str(v))
            elif key == "mean_response_length":
                row.append(f"{v:.1f}")
            else:
                row.append(f"{v:.3g}")
        if timings:
            row.append(f"{timings[i]['rollout_tokens_per_s']:.0f}")
            row.append(f"{timings[i]['peak_rss_gib']:.2f}")
        table.add_row(*row)
    return table
