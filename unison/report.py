"""``unison report RUN_DIR...``: overlaid curves and a comparison table of runs.

Per run: final training accuracy (mean reward of the last 5 steps), steps to
95% (first step where the 5-step moving average of the reward reaches 0.95),
mean and final token k3 and mean |π − μ|, skipped steps, wall time and tokens/s.
Writes ``report.md`` with the table and the PNGs it links.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import yaml

from unison.errors import UnisonError

WINDOW = 5


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """The resolved config and the metrics rows of a run directory, checked: a path that is not
    a run, a damaged file or a run without a single training step is a :class:`UnisonError`.
    Metrics are read with :func:`unison.data_io.read_metrics` (a torn last line, the trace of
    a killed writer, is dropped; a damaged line elsewhere is an error)."""
    from unison.data_io import read_metrics, read_text

    d = Path(run_dir)
    if not d.is_dir():
        raise UnisonError(f"'{d}' is not a run directory (no such directory): pass directories "
                          f"written by unison train or unison sanity")
    if not (d / "metrics.jsonl").is_file():
        raise UnisonError(f"'{d}' is not a run directory (no metrics.jsonl): pass directories "
                          f"written by unison train or unison sanity")
    cfg = {}
    if (d / "config.yaml").is_file():
        try:
            cfg = yaml.safe_load(read_text(d / "config.yaml", what="run config")) or {}
        except yaml.YAMLError as e:
            raise UnisonError(f"'{d / 'config.yaml'}' is not valid YAML ({str(e).splitlines()[0]}): "
                              f"restore it from the run's checkpoint or delete it") from e
        if not isinstance(cfg, dict):
            raise UnisonError(f"'{d / 'config.yaml'}' is not a mapping of config keys: restore it "
                              f"or delete it")
    rows = read_metrics(d / "metrics.jsonl", on_torn=_note)
    if not rows:
        raise UnisonError(f"'{d}' has no training steps in metrics.jsonl: nothing to report")
    return cfg, rows


_NOTED: set[str] = set()


def _note(message: str) -> None:
    """One line on stderr per damaged-but-readable file (a report must not pass over it silently)."""
    import sys

    if message not in _NOTED:
        _NOTED.add(message)
        print(f"unison: note: {message}", file=sys.stderr)


def summarize(run_dir: str | Path) -> dict:
    d = Path(run_dir)
    _, rows = load_run(d)
    # initial and final accuracy over 5 steps each, or over each half of a shorter run (never the same steps)
    w = WINDOW if len(rows) > WINDOW else max(1, len(rows) // 2)
    rewards = [r.get("reward/mean") for r in rows]
    steps_to_95 = None
    for i in range(len(rows)):
        win = [x for x in rewards[max(0, i - WINDOW + 1):i + 1] if isinstance(x, (int, float))]
        if i + 1 >= WINDOW and win and sum(win) / len(win) >= 0.95:
            steps_to_95 = rows[i]["step"]
            break
    last = rows[-WINDOW:]
    return {
        # a run is named by its directory (unison sanity names its arms precision-algorithm)
        "run": str(d), "arm": d.name, "steps": rows[-1]["step"] if rows else 0,
        "initial_accuracy": _mean(rewards[:w]),
        "final_accuracy": _mean(rewards[-w:]) if len(rows) > 1 else _mean(rewards),
        "steps_to_95": steps_to_95,
        "k3_mean": _mean([r.get("mismatch/k3") for r in rows]),
        "k3_final": _mean([r.get("mismatch/k3") for r in last]),
        "prob_diff_mean": _mean([r.get("mismatch/prob_diff_mean") for r in rows]),
        "prob_diff_max": max((r.get("mismatch/prob_diff_max") or 0.0 for r in rows), default=None),
        "skipped_steps": rows[-1].get("optim/skipped_steps", 0) if rows else 0,
        "wall_s": sum(r.get("time/step_s") or 0.0 for r in rows),
        "tokens_per_s": _mean([r.get("throughput/tokens_per_s") for r in rows]),
    }


COLUMNS = [("arm", "arm", "{}"), ("steps", "steps", "{}"), ("initial acc", "initial_accuracy", "{:.3f}"),
           ("final train acc", "final_accuracy", "{:.3f}"), ("steps to 95%", "steps_to_95", "{}"),
           ("mean k3", "k3_mean", "{:.2e}"), ("final k3", "k3_final", "{:.2e}"),
           ("mean abs(π−μ)", "prob_diff_mean", "{:.2e}"), ("skipped", "skipped_steps", "{}"),
           ("wall s", "wall_s", "{:.0f}"), ("tok/s", "tokens_per_s", "{:.0f}")]


def _cell(value, fmt):
    if value is None:
        return "–"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(summaries: list[dict]) -> str:
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "| " + " | ".join("---" for _ in COLUMNS) + " |"
    body = ["| " + " | ".join(_cell(s[k], f) for _, k, f in COLUMNS) + " |" for s in summaries]
    return "\n".join([head, sep, *body])


def rich_table(summaries: list[dict], title: str = "runs compared: one row per run"):
    from rich.table import Table

    t = Table(title=title)
    for name, _, _ in COLUMNS:
        t.add_column(name, justify="left" if name == "arm" else "right")
    for s in summaries:
        t.add_row(*[_cell(s[k], f) for _, k, f in COLUMNS])
    return t


def episodes_section(run_dir: Path, arm: str, show: int = 2) -> list[str]:
    """Multi-turn runs with ``log.rollouts``: the newest logged step's first episodes, turn by turn —
    ``[model]`` the tokens the model sampled (trained on), ``[env]`` what the environment's messages
    appended (context only)."""
    logs = sorted((Path(run_dir) / "rollouts").glob("step_*.jsonl"))
    if not logs:
        return []
    try:
        rows = [json.loads(x) for x in logs[-1].read_text(encoding="utf-8").splitlines() if x.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return []
    rows = sorted((r for r in rows if "turns" in r), key=lambda r: -len(r["turns"]))[:show]  # the longest
    if not rows:
        return []
    step = int(logs[-1].stem.split("_")[-1])
    out = ["", f"## Episodes (step {step}, turn by turn) — {arm}", "",
           "`[model]`: tokens the model sampled (log μ, trained on); `[env]`: tokens the environment's messages "
           "appended (context, no gradient).", ""]
    for r in rows:
        out += [f"Episode (group {r['group']}, sample {r['sample']}): reward {r['reward']:.3g}, {r['model_turns']} "
                f"model turns, {r['tool_calls']} tool calls ({r['tool_errors']} failed), ended: {r['ended']}"
                + (f" ({r['error']})" if r.get("error") else ""), "", "```", f"[prompt] {r['prompt_text']!r}"]
        for t in r["turns"]:
            extra = f"  Σ log μ {t['logp_mu_sum']:.2f}" if "logp_mu_sum" in t else ""
            out.append(f"[{t['by']}] {t['text']!r}  ({len(t['token_ids'])} tokens{extra})")
        out += ["```", ""]
    return out


def write_report(run_dirs, out_dir: str | Path, title: str = "unison report", notes: str = "") -> Path:
    from unison.plots import run_plots

    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise UnisonError("no run directory given: pass one or more RUN_DIRs")
    summaries = [summarize(d) for d in run_dirs]  # validates every dir first
    if len({s["arm"] for s in summaries}) < len(summaries):  # equal directory names: add their parents
        for s, d in zip(summaries, run_dirs):
            s["arm"] = f"{d.parent.name}/{d.name}"
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UnisonError(f"--out '{out_dir}' exists and is not a directory: choose another path")
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [s["arm"] for s in summaries]
    plots = run_plots(run_dirs, out_dir / "plots", labels=labels)
    from unison.data_io import atomic_write_text

    lines = [f"# {title}", "", notes, "", markdown_table(summaries), "",
             "Final train acc: mean training reward over the last 5 steps. Steps to 95%: first step "
             "where the 5-step moving average of the training reward reaches 0.95. k3 and abs(π−μ): "
             "mismatch between the rollout engine (μ) and the learner (π) on the sampled tokens.", ""]
    for p in plots:
        lines.append(f"![{p.stem}]({os.path.relpath(p, out_dir)})")
    for d, s in zip(run_dirs, summaries):
        lines += episodes_section(d, s["arm"])
    lines.append("")
    lines.append("Runs: " + ", ".join(f"`{s['run']}`" for s in summaries))
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    atomic_write_text(out_dir / "report.json", json.dumps({"arms": summaries}, indent=2) + "\n")
    return out_dir / "report.md"
