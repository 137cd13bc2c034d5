"""``unison report RUN_DIR...``: overlaid curves and a comparison table of runs.

Per run: initial and final training accuracy (mean reward of the first and of the last 5 steps;
"reward" rather than "acc" when the reward is not 0/1 — your own reward, reasoning_gym), steps to
95% (first step where the 5-step moving average of the reward reaches 0.95),
mean and final token k3 and mean |π − μ|, skipped steps, wall time and tokens/s.
Writes ``report.md`` with the table and the PNGs it links.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from pathlib import Path

import yaml

from unison.data_io import atomic_write_text
from unison.data_io import read_metrics, read_text
from unison.errors import UnisonError
from unison.plots import run_plots

WINDOW = 5


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """The resolved config and the metrics rows of a run directory, checked: a path that is not
    a run, a damaged file or a run without a single training step is a :class:`UnisonError`.
    Metrics are read with :func:`unison.data_io.read_metrics` (a torn last line, the trace of
    a killed writer, is dropped; a damaged line elsewhere is an error)."""
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


def binary_reward(cfg: dict) -> bool:
    """Whether a run's rewards are 0/1 (a built-in verifier: their mean is an accuracy), from its config."""
    task = cfg.get("task") or {}
    return (not task.get("reward") and task.get("name", "arithmetic") in ("arithmetic", "scratchpad", "math")
            and task.get("truncated_reward", 0.0) in (0, 1, None))


def summarize(run_dir: str | Path) -> dict:
    d = Path(run_dir)
    cfg, rows = load_run(d)
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
        "binary_reward": binary_reward(cfg),
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


def columns(summaries: list[dict]) -> list[tuple[str, str, str]]:
    """The table's columns: "acc" when every run's reward is 0/1, else "reward"."""
    if all(s.get("binary_reward", True) for s in summaries):
        return COLUMNS
    names = {"initial acc": "initial reward", "final train acc": "final reward"}
    return [(names.get(n, n), k, f) for n, k, f in COLUMNS]


def definitions(summaries: list[dict]) -> str:
    """What the columns mean (below every table)."""
    acc = all(s.get("binary_reward", True) for s in summaries)
    what = ("the training accuracy: mean reward of the sampled responses" if acc else
            "mean training reward (not an accuracy: a reward that is not 0/1)")
    return (f"Initial / final: {what} over the first / last 5 steps (a run of 5 steps or fewer: its first / second half). "
            f"Steps to 95%: first step where the 5-step moving average of the training reward reaches 0.95. "
            f"k3 and abs(π−μ): mismatch between the rollout engine (μ) and the learner (π) on the sampled tokens.")


def _cell(value, fmt):
    if value is None:
        return "–"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(summaries: list[dict]) -> str:
    cols = columns(summaries)
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    sep = "| " + " | ".join("---" for _ in cols) + " |"
    body = ["| " + " | ".join(_cell(s[k], f) for _, k, f in cols) + " |" for s in summaries]
    return "\n".join([head, sep, *body])


def rich_table(summaries: list[dict], title: str = "runs compared: one row per run"):
    from rich.table import Table

    cols = columns(summaries)
    t = Table(title=title, caption=definitions(summaries))
    for name, _, _ in cols:
        t.add_column(name, justify="left" if name == "arm" else "right", no_wrap=name == "arm")
    for s in summaries:
        t.add_row(*[_cell(s[k], f) for _, k, f in cols])
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




# ------------------------------------------------------------------ paired comparison by seed
#: Student's t, 97.5% quantile, for 1..30 degrees of freedom (two-sided 95% intervals)
_T975 = [12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
         2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
         2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272]


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (a table to 30, then the Cornish–Fisher
    expansion, within 1e-4)."""
    if df < 1:
        raise ValueError("a t-interval needs at least 2 observations")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def paired_interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean of paired differences and its 95% t-interval (t with n − 1 degrees of freedom): (mean, lo, hi)."""
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return mean, float("nan"), float("nan")
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


_SEED = re.compile(r"(.*)-s(\d+)$")


def arm_and_seed(run_dir: Path) -> tuple[str, int | None]:
    """``…/fp32-int4-grpo-s2`` -> (its arm name, 2): the directory name without unison sanity's seed suffix."""
    m = _SEED.match(run_dir.name)
    return (m.group(1), int(m.group(2))) if m else (run_dir.name, None)


def summarize_all(run_dirs: list[Path]) -> list[dict]:
    """:func:`summarize` of every run; runs whose directory names are equal are named with as many parents as
    tell them apart (:func:`arm_labels`) and their seed suffix."""
    summaries = [summarize(d) for d in run_dirs]
    if len({s["arm"] for s in summaries}) < len(summaries):
        for s, d, lab in zip(summaries, run_dirs, arm_labels(run_dirs)):
            seed = arm_and_seed(d)[1]
            s["arm"] = lab if seed is None else f"{lab}-s{seed}"
    return summaries


def arm_labels(run_dirs: list[Path]) -> list[str]:
    """One arm label per run: its name without the seed suffix, prefixed by as many parent directories (``arms/``
    skipped) as it takes to tell apart arms whose names are equal (``q-int4-qat/fp32-int4-grpo`` vs
    ``q-int4-grpo/fp32-int4-grpo``); the seeds of one arm share a directory, hence a label."""
    base = [arm_and_seed(d)[0] for d in run_dirs]
    labels = base
    for depth in range(0, 6):
        ups = [[p.name for p in d.parents if p.name not in ("arms", "")][:depth] for d in run_dirs]
        labels = ["/".join([*reversed(up), b]) for up, b in zip(ups, base)]
        dirs: dict[str, set] = {}
        for lab, d in zip(labels, run_dirs):
            dirs.setdefault(lab, set()).add(d.parent)
        if all(len(v) == 1 for v in dirs.values()):
            break
    return labels


PAIRED_KEYS = [("final_accuracy", "final train acc"), ("initial_accuracy", "initial acc"), ("k3_mean", "mean k3")]


def paired_table(values: dict[str, dict[int, dict[str, float]]], baseline: str, keys=PAIRED_KEYS) -> list[dict]:
    """Per arm against ``baseline``, for every summary number in ``keys``: the arm's mean ± sd over its seeds and
    the per-seed difference to the baseline over the seeds both ran (mean and 95% t-interval).
    ``values[arm][seed][key]``. Refuses an unknown baseline and arms that share no seed with it."""
    if baseline not in values:
        raise UnisonError(f"--baseline '{baseline}' is not one of the arms: {', '.join(sorted(values))}")
    base = values[baseline]
    rows = []
    for arm, seeds in values.items():
        shared = sorted(set(seeds) & set(base))
        if arm != baseline and not shared:
            raise UnisonError(f"arm '{arm}' shares no seed with the baseline '{baseline}' (seeds {sorted(seeds)} vs "
                              f"{sorted(base)}): a paired comparison needs the same seeds in both")
        row = {"arm": arm, "seeds": sorted(seeds), "shared_seeds": shared}
        for key, _ in keys:
            xs = [seeds[s][key] for s in sorted(seeds) if _finite(seeds[s].get(key))]
            row[key] = {"mean": sum(xs) / len(xs) if xs else None,
                        "sd": statistics.stdev(xs) if len(xs) > 1 else None}
            if arm != baseline:
                diffs = [seeds[s][key] - base[s][key] for s in shared
                         if _finite(seeds[s].get(key)) and _finite(base[s].get(key))]
                if diffs:
                    mean, lo, hi = paired_interval(diffs)
                    row[key].update(diff=mean, lo=lo, hi=hi, n=len(diffs))
        rows.append(row)
    return rows


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def paired_markdown(rows: list[dict], baseline: str, keys=PAIRED_KEYS, fmt: str = "{:.3f}") -> str:
    """The paired table as Markdown: mean ± sd per arm, then Δ vs the baseline with its 95% interval."""
    head = ["arm", "seeds"] + [f"{name} (mean ± sd)" for _, name in keys] + \
           [f"Δ {name} vs {baseline} [95% CI]" for _, name in keys]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        cells = [r["arm"], str(len(r["seeds"]))]
        for key, _ in keys:
            v = r[key]
            f = "{:.2e}" if key.startswith("k3") else fmt
            cells.append("–" if v["mean"] is None else f.format(v["mean"]) + ("" if v["sd"] is None else
                                                                             f" ± {f.format(v['sd'])}"))
        for key, _ in keys:
            v = r[key]
            f = "{:+.2e}" if key.startswith("k3") else "{:+.3f}"
            if r["arm"] == baseline:
                cells.append("(baseline)")
            elif "diff" not in v:
                cells.append("–")
            else:
                ci = "" if not math.isfinite(v["lo"]) else f" [{f.format(v['lo'])}, {f.format(v['hi'])}]"
                cells.append(f"{f.format(v['diff'])}{ci} (n={v['n']})")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_report(run_dirs, out_dir: str | Path, title: str = "unison report", notes: str = "",
                 baseline: str | None = None) -> Path:
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise UnisonError("no run directory given: pass one or more RUN_DIRs")
    summaries = summarize_all(run_dirs)  # validates every dir first
    paired = None
    if baseline is not None:
        by_arm: dict[str, dict[int, dict]] = {}
        for s_, d, lab in zip(summaries, run_dirs, arm_labels(run_dirs)):
            seed = arm_and_seed(d)[1]
            by_arm.setdefault(lab, {})[seed if seed is not None else _config_seed(d)] = s_
        paired = paired_table(by_arm, baseline)  # refuses a bad baseline before anything is written
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UnisonError(f"--out '{out_dir}' exists and is not a directory: choose another path")
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [s["arm"] for s in summaries]
    plots = run_plots(run_dirs, out_dir / "plots", labels=labels)

    lines = [f"# {title}", "", notes, "", markdown_table(summaries), "", definitions(summaries), ""]
    if paired is not None:
        lines += [f"## Paired by seed, against {baseline}", "",
                  "Each arm's mean ± sd over its seeds, and the mean of its per-seed differences to the baseline "
                  "over the seeds both ran, with a 95% t-interval (n − 1 degrees of freedom): arms that ran the same "
                  "seeds share their warm start, data order and early samples, so the paired difference is tighter "
                  "than two means ± sd.", "", paired_markdown(paired, baseline), ""]
    for p in plots:
        lines.append(f"![{p.stem}]({os.path.relpath(p, out_dir)})")
    views = [(s["arm"], d / "view.html") for d, s in zip(run_dirs, summaries) if (d / "view.html").is_file()]
    if views:  # the mismatch token by token (unison view)
        lines += ["", "Token by token (`unison view`): " + ", ".join(
            f"[{arm}]({os.path.relpath(v, out_dir)})" for arm, v in views), ""]
    for d, s in zip(run_dirs, summaries):
        lines += episodes_section(d, s["arm"])
    lines.append("")
    lines.append("Runs: " + ", ".join(f"`{s['run']}`" for s in summaries))
    atomic_write_text(out_dir / "report.md", "\n".join(lines) + "\n")
    payload = {"arms": summaries, **({"paired": {"baseline": baseline, "rows": paired}} if paired else {})}
    atomic_write_text(out_dir / "report.json", json.dumps(payload, indent=2) + "\n")
    return out_dir / "report.md"


def _config_seed(run_dir: Path) -> int:
    cfg, _ = load_run(run_dir)
    return int(cfg.get("seed", 0))
