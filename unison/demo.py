"""``unison demo`` (``make demo``): what unison is for, in a few minutes on two CPU cores.

1. Paper A's sanity test, shortened: the same GRPO run once per precision (fp16, bf16, fp32) — the
   mismatch each precision causes (token k3), and that at this scale none of them decides the outcome.
2. A run the mismatch breaks, and the same run with its cure, **on two seeds** (``REGIMES``): by default samples
   4 policy versions old (``rollout.max_staleness: 4``), cured by Token-TIS with the LR that follows the measured
   mismatch (``train.schedule: mismatch_budget`` from 0.1× of the LR); ``--regime int4``: int4 rollout weights with the
   quantization-aware learner (``train.quantization_aware: true``: π is the policy μ samples from). The clean run
   is beside them. docs/experiments/demo_recipe.md: the stale regime with its cure held on 6 seeds within 30 steps;
   the int4 regime's did not.
3. One report: both tables, part 2 per seed and its mean, the curves, each run's mismatch ledger, and one
   line saying what was seen on every seed — a cure is claimed only when it held on all of them.

The runs go two at a time, one process each (the tiny model computes on one thread; two side by side run 1.09×
slower than alone at K = 0, 1.29× at K = 4 — each is a learner and an engine worker: benchmarks/demo_side_by_side.py). Both parts start from warm starts shipped with unison (``unison/data/demo``:
the SFT model and the perfectible set ``unison sanity`` would make first, made by
``scripts/make_demo_warm_starts.py``); ``--from-scratch`` makes them instead. Everything is built on
``unison sanity`` (one directory per arm); rerunning with the same ``--out`` reuses what is finished.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unison.config import Config
from unison.config import config_from_dict
from unison.data_io import atomic_write_text
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.ledger import TERMS
from unison.plots import demo_plot, ledger_plot
from unison.report import markdown_table
from unison.report import summarize
from unison.runtime import die_with_parent
from unison.sanity import run_sanity
from unison.sanity import warm_start

#: part 2: the cure, as an arm variant (name suffix, config overrides)
CURE = ("-qat", {"train": {"quantization_aware": True}})
#: part 1's length: the arithmetic sanity test reaches 95% by step ≈ 20 on the CPUs measured
PRECISION_STEPS = ["train.steps=30"]
#: part 2's base recipe (experiments/demo_recipe, docs/experiments/demo_recipe.md: 6 seeds, every candidate): chained
#: sums with the working written out (69-token answers), 16 prompts × 8, 4 mini-batches per step, lr 1e-4, 30 steps
COLLAPSE_RECIPE = ["task.name=scratchpad", "task.operands=7", "task.digits=2", "task.style=full",
                   "task.train_size=600", "task.eval_size=200", "rollout.max_new_tokens=96", "sft.steps=600",
                   "train.steps=30", "train.lr=1e-4", "train.prompts_per_step=16", "rollout.n=8",
                   "train.mini_batches=4", "train.micro_batch_size=64", "train.micro_batch_tokens=null"]


@dataclass(frozen=True)
class Regime:
    """Part 2: a regime where the mismatch decides the outcome — its runs (kind -> (label, rollout quantization,
    ``run_sanity`` variant): clean, broken, cured and, where the cure has two parts, the control: the cure without
    the part it credits), what its recipe adds to ``COLLAPSE_RECIPE``, the words its verdict uses and the ledger term
    that carries its mismatch."""

    recipe: list[str]
    arms: dict
    title: str
    broken: str
    cure: str
    cure_run: str
    term: str
    control: str = ""  # the verdict's words for the control run, when the regime has one


STALE = {"rollout": {"max_staleness": 4}}
#: the stale regime's cure (docs/experiments/demo_recipe.md, 6 seeds): Token-TIS, the off-policy correction
#: (grpo_token_tis: each token weighted by min(π_old/μ, 2)), with the mismatch-budget LR that starts at 0.1× and earns
#: its LR while the k3 stays under half of 3e-3 — the default budget (full LR from step 1, target 1e-2)
#: reacts only after the first updates on stale samples have broken the run, and the budget alone held 5/6 seeds
#: The budget watches mismatch/k3, the whole k3 of μ against π_old: part 2 runs fp32 on both sides, where that is the
#: staleness (the ledger puts 100% of it there), and it needs no pass of its own — the search's runs watched
#: mismatch/staleness_k3, a second score pass a step, and seeds 0 and 1 ran step for step the same with either
STALE_CURE = {**{"rollout": {"max_staleness": 4}}, "algo": "grpo_token_tis",
              "train": {"schedule": "mismatch_budget",
                        "mismatch_budget": {"start": 0.1, "target": 3e-3, "metric": "mismatch/k3"}}}
REGIMES = {
    # samples 4 policy versions old (the native engine runs ahead in a worker process), and Paper B's cure: the LR
    # follows the measured mismatch (docs/lr-schedule.md) — the pick of docs/experiments/demo_recipe.md
    "stale": Regime(
        # 25 steps: the six runs fit the demo's 6 minutes; the search's 6 seeds pass at 25 steps as at 30 (their first
        # 25 steps are these runs step for step: nothing in the recipe depends on the run's length)
        recipe=["train.micro_batch_tokens=4096", "mismatch.decompose_every=5", "rollout.worker_threads=1",
                "train.steps=25"],
        arms={"clean": ("clean: fresh samples (K = 0)", "none", ("-k0", {"rollout": {"max_staleness": 0}})),
              "broken": ("samples 4 versions old, GRPO", "none", ("-k4", STALE)),
              "cured": ("samples 4 versions old + Token-TIS + mismatch-budget LR", "none",
                        ("-k4-tis-budget", STALE_CURE)),
              # the control: the correction alone at the run's LR — what the budget's LR adds
              "control": ("samples 4 versions old + Token-TIS at the run's LR (control)", "none",
                          ("-k4-tis", {**STALE, "algo": "grpo_token_tis"}))},
        title="samples 4 policy versions old", broken="the K = 4 run",
        cure="the off-policy correction (Token-TIS) with the learning rate that follows the measured mismatch "
             "(train.schedule=mismatch_budget from 0.1× of the LR, k3 target 3e-3) cured it",
        cure_run="the corrected run", term="staleness",
        control="Token-TIS alone at the run's LR (the control, no budget)"),
}


def _quantized(fmt: str) -> Regime:
    """``fmt`` rollout weights (int4; the 4-bit block formats mxfp4, nvfp4), and the quantization-aware learner (π is
    the policy μ samples from)."""
    return Regime(recipe=[], arms={"clean": ("clean: fp32 rollout", "none", None),
                                   "broken": (f"{fmt} rollout, GRPO", fmt, None),
                                   "cured": (f"{fmt} rollout + quantization_aware", fmt, CURE)},
                  title=f"{fmt} rollout weights", broken=f"the {fmt} run",
                  cure="computing the learner through the rollout's quantizer (train.quantization_aware=true) cured it",
                  cure_run="the quantization-aware run", term="quantization")


REGIMES.update({fmt: _quantized(fmt) for fmt in ("int4", "mxfp4", "nvfp4")})
DEFAULT_REGIME = "stale"
#: part 2's seeds (each run once per seed, side by side)
SEEDS = [0, 1]
#: a collapse: the broken run ends below this fraction of the clean run; a cure: at or above CURED of it
COLLAPSED, CURED = 0.80, 0.95
#: the shipped warm starts (package data), one directory per part
WARM_STARTS = Path(__file__).resolve().parent / "data" / "demo"
#: written into a part's ``sft/`` when its warm start is a shipped copy (``--from-scratch`` then replaces it)
SHIPPED = "shipped.json"


def drop_shipped(part_dir: Path, log) -> None:
    """``--from-scratch``: a part holding a shipped copy (from an earlier run with the same ``--out``) gets its own."""
    if (part_dir / "sft" / SHIPPED).exists():
        log(f"[demo] {part_dir}: replacing the shipped warm start copied there before (--from-scratch)")
        shutil.rmtree(part_dir / "sft")
        (part_dir / "perfectible.jsonl").unlink(missing_ok=True)


def fingerprint(cfg: Config, k: int, max_prompts: int | None) -> dict:
    """What a warm start depends on: the base model, the seed, the task, the SFT, the precision, engine and
    sampling settings the filter samples with, and the filter's size. A shipped warm start serves a run only when they are equal."""
    d = cfg.model_dump(mode="json")
    return {"model": d["model"], "seed": d["seed"], "task": d["task"], "sft": d["sft"],
            "precision": d["precision"], "rollout_precision": d["rollout_precision"], "engine": d["engine"],
            "rollout": {key: d["rollout"][key] for key in ("temperature", "max_new_tokens")},
            "k": k, "max_prompts": max_prompts}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def seed_warm_start(cfg: Config, part_dir: Path, name: str, k: int, max_prompts: int | None, log) -> bool:
    """Put the shipped warm start of part ``name`` under ``part_dir`` (``sft/`` and ``perfectible.jsonl``) when
    none is there yet and it was made with this configuration; True when the part then has one."""
    if (part_dir / "sft" / "model" / "config.json").exists():  # a warm start of its own (made, or copied before)
        return (part_dir / "perfectible.jsonl").exists()
    src = WARM_STARTS / name
    manifest_path = src / "manifest.json"
    if not manifest_path.exists():
        log(f"[demo] no shipped warm start for part '{name}': making one")
        return False
    manifest = json.loads(manifest_path.read_text())
    if manifest["fingerprint"] != fingerprint(cfg, k, max_prompts):
        log(f"[demo] the shipped warm start of part '{name}' is the built-in recipe's, and this run changes it "
            f"(a config or --set touching the model, seed, task, sft, rollout sampling or the filter): making one")
        return False
    for rel, digest in manifest["files"].items():
        if _sha256(src / rel) != digest:
            raise UnisonError(f"the shipped warm start {src / rel} does not match its manifest (sha256): reinstall "
                              f"unison, or run `unison demo --from-scratch`")
    tmp = part_dir / ".warm-start.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "sft").mkdir(parents=True)
    shutil.copytree(src / "model", tmp / "sft" / "model")
    shutil.copy(src / "sft.json", tmp / "sft" / "sft.json")
    shutil.copy(src / "perfectible.jsonl", tmp / "perfectible.jsonl")
    part_dir.mkdir(parents=True, exist_ok=True)
    (tmp / "sft" / SHIPPED).write_text(json.dumps({"fingerprint": manifest["fingerprint"]}) + "\n")
    shutil.rmtree(part_dir / "sft", ignore_errors=True)
    (tmp / "sft").rename(part_dir / "sft")
    (tmp / "perfectible.jsonl").replace(part_dir / "perfectible.jsonl")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"[demo] part '{name}': the shipped warm start (SFT eval accuracy {manifest['sft']['eval_accuracy_sampled']:.3f} "
        f"sampled, made on {manifest['cpu']}; `unison demo --from-scratch` makes its own)")
    return True


def _arm(job: dict) -> list[str]:
    """One arm of ``unison sanity`` in a process of its own (a worker of the demo's pool)."""
    cfg = config_from_dict(job["cfg"])
    variant = (job["variant"][0], job["variant"][1]) if job["variant"] else None
    prefix = job["label"]
    _, _, dirs = run_sanity(cfg, Path(job["out"]), job["precisions"], ["grpo"], k=job["k"],
                            max_prompts=job["max_prompts"], seeds=job["seeds"], quantizations=job["quantizations"],
                            variant=variant, report=False,
                            log=lambda m: print(f"[{prefix}] {m}" if m.startswith("[sanity] arm") else m,
                                                file=sys.stderr, flush=True))
    return [str(d) for d in dirs]


def run_demo(precision_cfg: Config, collapse_cfg: Config, out: Path, precisions: list[str],
             log=lambda m: print(m, file=sys.stderr, flush=True), regime: str = DEFAULT_REGIME, k: int = 8,
             max_prompts: int | None = 32, collapse_prompts: int | None = 64, seeds: list[int] | None = None,
             from_scratch: bool = False, workers: int = 2) -> dict:
    """Run the demo's two parts (``out/precision``, ``out/collapse``), ``workers`` runs at a time, and write
    ``out/report.md``."""
    seeds = list(SEEDS if seeds is None else seeds)
    t0 = time.perf_counter()
    parts = {"precision": (precision_cfg, max_prompts), "collapse": (collapse_cfg, collapse_prompts)}
    for name, (cfg, mp_) in parts.items():  # the warm starts first: every run of a part shares its own
        if from_scratch:
            drop_shipped(out / name, log)
        else:
            seed_warm_start(cfg, out / name, name, k, mp_, log)
        log(f"[demo] part '{name}': warm start")
        warm_start(cfg, out / name, k=k, max_prompts=mp_, log=log)
    t_warm = time.perf_counter() - t0
    common = dict(k=k)
    jobs, part2 = [], []
    reg = REGIMES[regime]
    kinds = part2_kinds(reg)
    for kind in ("cured", "control", "broken", "clean"):  # the longest first: two workers finish together
        if kind not in reg.arms:
            continue
        _, quant, variant = reg.arms[kind]
        for s in seeds:
            job = dict(common, cfg=collapse_cfg.model_dump(mode="json"), out=str(out / "collapse"),
                       precisions=["fp32"], seeds=[s], quantizations=[quant], variant=variant,
                       max_prompts=collapse_prompts, label=f"{kind} s{s}")
            jobs.append(job)
            part2.append((kind, s, job))
    for p in precisions:
        jobs.append(dict(common, cfg=precision_cfg.model_dump(mode="json"), out=str(out / "precision"),
                         precisions=[p], seeds=None, quantizations=["none"], variant=None,
                         max_prompts=max_prompts, label=f"{p}"))
    log(f"[demo] {len(jobs)} runs, {workers} at a time: part 2 ({len(part2)}: "
        f"{', '.join(lab for lab, _, _ in reg.arms.values())}; seeds {', '.join(map(str, seeds))}), then part 1 "
        f"({', '.join(precisions)})")
    results = _run_all(jobs, workers)
    wall_runs = time.perf_counter() - t0 - t_warm
    dirs = {id(j): [Path(d) for d in r] for j, r in zip(jobs, results)}
    prec_dirs = [d for j in jobs[len(part2):] for d in dirs[id(j)]]
    runs = {(kind, s): dirs[id(job)][0] for kind, s, job in part2}
    per_seed = [judge_seed(s, *(_rows(runs[(kind, s)]) for kind in ("clean", "broken", "cured")), term=reg.term,
                           control_rows=_rows(runs[("control", s)]) if "control" in reg.arms else None)
                for s in seeds]
    headline = headline_text(per_seed, reg)
    part2_runs = [(f"{reg.arms[kind][0]}, seed {s}", runs[(kind, s)]) for kind in kinds for s in seeds]
    wall = {"warm starts": t_warm, "runs": wall_runs}
    report = write_demo_report(out, prec_dirs, part2_runs, per_seed, headline, precision_cfg, collapse_cfg, wall,
                               reg, len(seeds))
    arms = [summarize(d) for d in prec_dirs + [d for _, d in part2_runs]]
    for s, (lab, _) in zip(arms[len(prec_dirs):], part2_runs):  # part 2's fp32 runs are not part 1's: say which is which
        s["arm"] = lab
    return {"report": report, "headline": headline, "arms": arms, "per_seed": per_seed,
            "wall_s": time.perf_counter() - t0}


def part2_kinds(reg: Regime) -> list[str]:
    """Part 2's runs in the report's order: clean, broken, cured, then the control where the regime has one."""
    return [k for k in ("clean", "broken", "cured", "control") if k in reg.arms]


def _run_all(jobs: list[dict], workers: int) -> list[list[str]]:
    """Every job in a pool of ``workers`` processes (spawned: a fresh interpreter each, one thread each), in
    order; one process when ``workers`` is 1. A failure ends the demo with the failing run's error."""
    if workers <= 1:
        return [_arm(j) for j in jobs]
    # the workers die with the demo, even one SIGKILLed or sent SIGTERM alone (not its process group)
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(_arm, j) for j in jobs]
        try:
            return [f.result() for f in futures]
        except cf.process.BrokenProcessPool as e:
            pool.shutdown(wait=False, cancel_futures=True)
            raise UnisonError(f"a demo run's process died ({e}): what finished is kept; rerun with the same --out "
                              f"to go on") from None
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _rows(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl")


def _tail(rows, key="reward/mean", n=10):
    xs = [r[key] for r in rows[-n:] if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(xs) / len(xs) if xs else float("nan")


def judge_seed(seed: int, clean_rows, broken_rows, cured_rows, term: str = "quantization", control_rows=None) -> dict:
    """One seed of part 2: each run's training accuracy over its last 10 steps (the broken run's first 10 too),
    whether the broken run collapsed (ended below COLLAPSED × the clean run), whether the cure held (ended at
    CURED × the clean run or above) and, given the control's rows, whether the control held by the same rule."""
    clean, broken, cured = _tail(clean_rows), _tail(broken_rows), _tail(cured_rows)
    ledger = [r for r in broken_rows if f"ledger/{term}_k3" in r]
    share = None
    if ledger:
        last = ledger[-1]
        terms = [k for k in last if k.startswith("ledger/") and k.endswith("_k3") and k != "ledger/total_k3"]
        tot = sum(max(last[k], 0.0) for k in terms) or 1.0
        share = max(last[f"ledger/{term}_k3"], 0.0) / tot
    out = {"seed": seed, "clean": clean, "broken": broken, "cured": cured, "broken_start": _tail(broken_rows[:10]),
           "collapsed": broken < COLLAPSED * clean, "cure_held": cured >= CURED * clean,
           "cure_collapsed": cured < COLLAPSED * clean, "term_share": share}
    if control_rows is not None:
        control = _tail(control_rows)
        out.update(control=control, control_held=control >= CURED * clean)
    return out


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1``: distinct integers, at least one (one line naming the fix otherwise)."""
    try:
        seeds = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UnisonError(f"--seeds '{text}' is not a list of integers: write e.g. --seeds 0,1") from None
    if not seeds:
        raise UnisonError("--seeds is empty: name at least one, e.g. --seeds 0,1")
    if len(set(seeds)) != len(seeds):
        raise UnisonError(f"--seeds '{text}' names a seed twice: each seed runs once, e.g. --seeds 0,1")
    return seeds


def verdict(per_seed: list[dict], regime: Regime = REGIMES["int4"]) -> str:
    """What part 2 showed over its seeds. A cure is claimed only when the broken run collapsed and the cure held on
    every seed; otherwise the line says, seed by seed, what was seen."""
    n = len(per_seed)
    collapsed = [p for p in per_seed if p["collapsed"]]
    held = [p for p in collapsed if p["cure_held"]]
    both = [p for p in collapsed if p["cure_collapsed"]]

    def seeds(ps):
        return ", ".join(str(p["seed"]) for p in ps)

    if not collapsed:
        return (f"{regime.broken} did not collapse on any of the {n} seeds (it ended at {COLLAPSED:.0%} of the "
                f"clean run or above), so this run cannot show the cure; docs/experiments/demo_recipe.md has 6 seeds")
    if len(collapsed) == n and len(held) == n:
        return (f"on every seed ({n}/{n}) {regime.broken} collapsed, and {regime.cure} (≥ {CURED:.0%} of the "
                f"clean run)" + control_clause(per_seed, regime))
    parts = [f"{regime.broken} collapsed on {len(collapsed)}/{n} seeds ({seeds(collapsed)})"]
    if held:
        parts.append(f"{regime.cure_run} held on {len(held)} of them ({seeds(held)})")
    missed = [p for p in collapsed if not p["cure_held"] and not p["cure_collapsed"]]
    if missed:
        parts.append(f"{regime.cure_run} ended below {CURED:.0%} of the clean run on seed{'s' if len(missed) > 1 else ''} "
                     f"{seeds(missed)}")
    if both:
        parts.append(f"{regime.cure_run} ended below {COLLAPSED:.0%} of the clean run as well on "
                     f"seed{'s' if len(both) > 1 else ''} {seeds(both)}")
    return "; ".join(parts) + ": no cure is claimed (it must hold on every seed)"


def control_clause(per_seed: list[dict], regime: Regime) -> str:
    """What the control showed, for a verdict that claims the cure: held on no seed (the part the control leaves
    out decided it), on some, or on every seed (the cure's credited part did not decide it)."""
    if not regime.control or any("control" not in p for p in per_seed):
        return ""
    n, held = len(per_seed), [p for p in per_seed if p["control_held"]]
    if not held:
        return (f"; {regime.control} did not ({0}/{n} seeds at ≥ {CURED:.0%}): the learning rate decided it — a "
                f"constant low LR found by a search cures as well (docs/experiments/demo_recipe.md)")
    if len(held) == n:
        return (f"; {regime.control} held as well ({n}/{n}): on these seeds the budget's LR is not what cured it")
    return (f"; {regime.control} held on {len(held)}/{n} seeds "
            f"({', '.join(str(p['seed']) for p in held)}): the budget's LR was needed on the others")


def headline_text(per_seed: list[dict], regime: Regime = REGIMES["int4"]) -> str:
    def mean(key):
        xs = [p[key] for p in per_seed if math.isfinite(p[key])]
        return sum(xs) / len(xs) if xs else float("nan")

    each = "; ".join(f"seed {p['seed']}: {p['broken_start']:.2f} → {p['broken']:.2f}, cured {p['cured']:.2f}, "
                     + (f"control {p['control']:.2f}, " if "control" in p else "")
                     + f"clean {p['clean']:.2f}" for p in per_seed)
    control = f", the control {mean('control'):.2f}" if all("control" in p for p in per_seed) else ""
    shares = [p["term_share"] for p in per_seed if p["term_share"] is not None]
    share = (f"; the ledger put {100 * sum(shares) / len(shares):.0f}% of the broken runs' mismatch on {regime.term}"
             if shares else "")
    n = len(per_seed)
    return (f"{regime.title}, GRPO training accuracy (last 10 steps), mean of {n} seed{'s' if n > 1 else ''}: "
            f"{mean('broken_start'):.2f} → {mean('broken'):.2f}; {regime.cure_run} {mean('cured'):.2f}{control}, the clean run "
            f"{mean('clean'):.2f} ({each}){share}: {verdict(per_seed, regime)}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.0%}" if b else "–"


def seed_table(per_seed: list[dict], regime: Regime = REGIMES["int4"]) -> list[str]:
    """Markdown: part 2 per seed and the mean."""
    broken, cured = regime.arms["broken"][0], regime.arms["cured"][0]
    ctl = all("control" in p for p in per_seed)
    extra = f" {regime.arms['control'][0]} | control / clean |" if ctl else ""
    out = [f"| seed | clean | {broken} (first 10 → last 10) | broken / clean | {cured} | cured / clean |{extra} outcome |",
           "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if ctl else "") + " --- |"]
    for p in per_seed:
        outcome = ("no collapse" if not p["collapsed"] else "cured" if p["cure_held"]
                   else f"not cured (< {COLLAPSED:.0%})" if p["cure_collapsed"] else f"not cured (< {CURED:.0%})")
        c = f" {p['control']:.3f} | {_ratio(p['control'], p['clean'])} |" if ctl else ""
        out.append(f"| {p['seed']} | {p['clean']:.3f} | {p['broken_start']:.3f} → {p['broken']:.3f} | "
                   f"{_ratio(p['broken'], p['clean'])} | {p['cured']:.3f} | {_ratio(p['cured'], p['clean'])} |{c} {outcome} |")
    n = len(per_seed)
    m = {k: sum(p[k] for p in per_seed) / n for k in ("clean", "broken", "cured", "broken_start")
         + (("control",) if ctl else ())}
    c = f" {m['control']:.3f} | {_ratio(m['control'], m['clean'])} |" if ctl else ""
    out.append(f"| mean | {m['clean']:.3f} | {m['broken_start']:.3f} → {m['broken']:.3f} | {_ratio(m['broken'], m['clean'])} "
               f"| {m['cured']:.3f} | {_ratio(m['cured'], m['clean'])} |{c} |")
    return out


def write_demo_report(out: Path, prec_dirs, runs, per_seed, headline: str, cfg1: Config, cfg2: Config,
                      wall: dict, regime: Regime = REGIMES["int4"], n_seeds: int = 1) -> Path:
    """``out/report.md``: part 1's table, part 2 per run and per seed, the curves, the ledger, the headline.
    ``runs``: part 2's (label, run directory), kind by kind, ``n_seeds`` of each."""
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    series = [(lab, read_metrics(d / "metrics.jsonl")) for lab, d in runs]
    curves, led = demo_plot(series, plots, per_color=n_seeds), ledger_plot(series, plots)
    prec = [summarize(d) for d in prec_dirs]
    cure = [summarize(d) for _, d in runs]
    for s, (lab, _) in zip(cure, runs):
        s["arm"] = lab

    def recipe(c, seeds=None):
        return (f"{c.task.name}, {c.train.prompts_per_step} prompts × {c.rollout.n} samples per step, "
                f"{c.train.mini_batches} mini-batch{'es' if c.train.mini_batches > 1 else ''}, lr {c.train.lr}, "
                f"{c.train.steps} steps, " + (f"seeds {seeds}" if seeds else f"seed {c.seed}"))

    seeds = ", ".join(str(p["seed"]) for p in per_seed)
    lines = ["# unison demo", "", headline + ".", "",
             f"Wall time: warm starts {wall['warm starts'] / 60:.1f} min (shipped ones are copied; "
             f"`--from-scratch` makes them), the runs {wall['runs'] / 60:.1f} min.", "",
             f"## 1. Precision: the mismatch each precision causes ({recipe(cfg1)})", "", markdown_table(prec), "",
             f"## 2. A run the mismatch breaks, and the same run with its cure: {regime.title} ({recipe(cfg2, seeds)})", "",
             f"Each seed's training accuracy over its last 10 steps; a collapse ends below {COLLAPSED:.0%} of the "
             f"clean run, a cure at {CURED:.0%} of it or above. Seeds stand in for CPUs: another CPU changes the "
             f"sampled path as another seed does.", "", *seed_table(per_seed, regime), "",
             markdown_table(cure), "", f"![curves]({curves.relative_to(out)})", ""]
    if led:
        lines += ["Where each run's mismatch came from (the mismatch ledger, docs/ledger.md): the mean k3 of each term "
                  "over the run's ledger steps, and its share of their sum:", "",
                  *ledger_table([(s["arm"], d) for s, d in zip(prec + cure, [*prec_dirs, *(d for _, d in runs)])]),
                  "", f"![ledger]({led.relative_to(out)})", ""]
    lines += ["Runs: " + ", ".join(f"`{d}`" for d in [*prec_dirs, *(d for _, d in runs)]), ""]
    views = [(s["arm"], Path(d) / "view.html") for s, d in zip(prec + cure, [*prec_dirs, *(d for _, d in runs)])]
    views = [(lab, os.path.relpath(v, out)) for lab, v in views if v.exists()]
    if views:  # the mismatch token by token (unison view), each run's page
        lines += ["Token by token (`unison view`, each run's last step; a button for its step of largest k3): "
                  + ", ".join(f"[{lab}]({v})" for lab, v in views), ""]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return out / "report.md"


def ledger_table(runs) -> list[str]:
    """Markdown rows: per run, the mean ``ledger/<term>_k3`` over its ledger steps and each term's share."""
    rows, used = [], []
    for name, d in runs:
        logged = [r for r in read_metrics(d / "metrics.jsonl") if "ledger/total_k3" in r]
        if not logged:
            continue
        means = {t: sum(r[f"ledger/{t}_k3"] for r in logged) / len(logged)
                 for t in TERMS if all(f"ledger/{t}_k3" in r for r in logged)}
        used += [t for t in means if t not in used]
        rows.append((name, len(logged), sum(r["ledger/total_k3"] for r in logged) / len(logged), means))
    if not rows:
        return ["(no ledger step)"]
    terms = [t for t in TERMS if t in used]
    out = ["| run | ledger steps | mean total k3 | " + " | ".join(terms) + " |",
           "| --- | --- | --- | " + " | ".join("---" for _ in terms) + " |"]
    for name, n, total, means in rows:
        tot = sum(max(v, 0.0) for v in means.values()) or 1.0
        out.append(f"| {name} | {n} | {total:.2e} | " + " | ".join(
            f"{means[t]:.2e} ({100 * max(means[t], 0.0) / tot:.0f}%)" if t in means else "–" for t in terms) + " |")
    return out
