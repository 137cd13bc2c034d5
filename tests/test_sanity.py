"""The perfectible filter, the report, and `unison sanity` end to end (small)."""

import json
import re

import pytest

from unison.cli import main
from unison.config import load_config
from unison.errors import UnisonError
from unison.filter import in_band, parse_band, run_filter
from unison.report import markdown_table, summarize


def test_band_parsing_and_membership():
    assert parse_band(None) is None and parse_band("0.2,0.8") == (0.2, 0.8)
    assert [in_band(r, None) for r in (0.0, 0.125, 1.0)] == [False, True, False]
    assert [in_band(r, (0.25, 0.5)) for r in (0.125, 0.25, 0.5, 0.625)] == [False, True, True, False]
    for bad in ("0.8,0.2", "x", "0.1,1.5"):
        with pytest.raises(UnisonError):
            parse_band(bad)


# 1-digit sums, differences and products: 280 of the 300 problems to train on, so that a
# minute of SFT leaves the model right on some prompts and wrong on others
TASK = ["task.digits=1", 'task.operators=["+","-","*"]', "task.train_size=280", "task.eval_size=20",
        "rollout.max_new_tokens=4"]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """A briefly supervised tiny model that is right on some 1-digit sums, wrong on others."""
    from unison.sft import run_sft

    out = tmp_path_factory.mktemp("sft")
    cfg = load_config(None, TASK + ["sft.steps=60", "sft.batch_size=32"])
    run_sft(cfg, out, log=lambda m: None)
    return out / "model"


def test_filter_respects_the_band_and_is_deterministic(tmp_path, sft_model):
    cfg = load_config(None, TASK + [f"model={sft_model}"])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_filter(cfg, a, k=4, log=lambda m: None)
    run_filter(cfg, b, k=4, log=lambda m: None)
    assert a.read_text() == b.read_text()
    rows = [json.loads(x) for x in a.read_text().splitlines()]
    assert rows and all(0 < r["pass_rate"] < 1 for r in rows)
    assert all(r["pass_rate"] * 4 == int(r["pass_rate"] * 4) for r in rows)  # k = 4 samples
    c = tmp_path / "c.jsonl"
    run_filter(cfg, c, k=4, band=(0.5, 0.75), max_prompts=3, log=lambda m: None)
    rows_c = [json.loads(x) for x in c.read_text().splitlines()]
    assert 1 <= len(rows_c) <= 3 and all(0.5 <= r["pass_rate"] <= 0.75 for r in rows_c)
    # the kept prompts become the training split of the task
    from unison.tasks import make_task

    task = make_task(load_config(None, TASK + [f"task.path={a}"]).task)
    assert [t.prompt for t in task.train] == [r["prompt"] for r in rows]
    assert not {t.prompt for t in task.train} & {t.prompt for t in task.eval}


def _write_run(d, rewards, k3, skipped=0):
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("precision: fp16\nalgo: grpo\n")
    rows = [{"step": i + 1, "reward/mean": r, "mismatch/k3": k, "mismatch/prob_diff_mean": k,
             "mismatch/prob_diff_max": 2 * k, "optim/skipped_steps": skipped, "time/step_s": 2.0,
             "throughput/tokens_per_s": 100.0, "response_length/mean": 3.0, "optim/lr": 1e-4,
             "optim/loss_scale": 65536.0} for i, (r, k) in enumerate(zip(rewards, k3))]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_summary_by_hand(tmp_path):
    rewards = [0.5, 0.6, 0.9, 1.0, 1.0, 1.0, 0.9, 1.0]
    _write_run(tmp_path / "a", rewards, [1e-6] * 4 + [3e-6] * 4, skipped=1)
    s = summarize(tmp_path / "a")
    assert s["arm"] == "a" and s["steps"] == 8  # runs are named by their directory
    assert s["initial_accuracy"] == pytest.approx(sum(rewards[:5]) / 5)
    assert s["final_accuracy"] == pytest.approx(sum(rewards[-5:]) / 5)
    # a run of 4 steps: the first and the last 2 (never the same steps)
    _write_run(tmp_path / "short", [0.1, 0.2, 0.8, 0.9], [1e-6] * 4)
    short = summarize(tmp_path / "short")
    assert (short["initial_accuracy"], short["final_accuracy"]) == (pytest.approx(0.15), pytest.approx(0.85))
    # 5-step moving averages: step 5 = 0.8, 6 = 0.9, 7 = 0.96 -> first >= 0.95 at step 7
    assert s["steps_to_95"] == 7
    assert s["k3_mean"] == pytest.approx(2e-6) and s["k3_final"] == pytest.approx((1e-6 + 4 * 3e-6) / 5)
    assert s["skipped_steps"] == 1 and s["wall_s"] == pytest.approx(16.0)
    table = markdown_table([s])
    assert "| a | 8 |" in table and "| 7 |" in table


def test_report_cli_overlays_runs(tmp_path):
    _write_run(tmp_path / "a", [0.5] * 6, [1e-6] * 6)
    _write_run(tmp_path / "b", [0.4] * 6, [1e-4] * 6)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    # both runs are fp16/grpo: the table names them by directory instead
    assert "| a |" in md and "| b |" in md and "plots/training_curves.png" in md
    assert (tmp_path / "rep" / "plots" / "training_curves.png").stat().st_size > 10_000
    assert main(["report", str(tmp_path / "nope")]) == 2


def test_report_reads_metrics_like_the_trainer_and_refuses_empty_runs(tmp_path, capsys):
    # a torn last line (the trace of a SIGKILL during a write) is dropped, not a traceback
    _write_run(tmp_path / "a", [0.5, 0.6, 0.7], [1e-6] * 3)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')
    assert summarize(tmp_path / "a")["steps"] == 3
    assert "metrics.jsonl:4: the last line is cut short" in capsys.readouterr().err  # said once, not silently
    # no steps at all: refused, and nothing is written into the run directory
    _write_run(tmp_path / "e", [], [])
    before = sorted(p.name for p in (tmp_path / "e").iterdir())
    assert main(["report", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"unison: error: '{tmp_path / 'e'}' has no training steps in metrics.jsonl: "
                   f"nothing to report")
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == before
    # every run is validated before --out is created
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "e"), "--out", str(tmp_path / "rep")]) == 2
    assert not (tmp_path / "rep").exists()


def test_sanity_end_to_end_small(tmp_path, capsys):
    out = tmp_path / "s"
    args = ["sanity", "--out", str(out), "--precisions", "fp32,fp16", "--k", "4", "--max-prompts", "8",
            "--set", "sft.steps=60", "--set", "sft.batch_size=32", "--set", "train.steps=3",
            "--set", "train.prompts_per_step=4", "--set", "rollout.n=4", "--set", "checkpoint.every=0"]
    args += [x for kv in TASK for x in ("--set", kv)]
    assert main(args) == 0
    assert (out / "sft" / "model" / "config.json").exists()
    assert 1 <= len((out / "perfectible.jsonl").read_text().splitlines()) <= 8
    report = json.loads((out / "report.json").read_text())["arms"]
    assert [a["arm"] for a in report] == ["fp32-grpo", "fp16-grpo"]
    assert all(a["steps"] == 3 for a in report)
    k3 = {a["arm"]: a["k3_mean"] for a in report}
    assert k3["fp16-grpo"] > k3["fp32-grpo"]
    assert "| fp16-grpo |" in (out / "report.md").read_text()
    # the last progress line counts RL steps only, and times SFT and the filter apart
    assert re.search(r"\[sanity\] 4/4 report \(RL: 6 steps in \d+m\d\ds; SFT \d+m\d\ds; filter \d+m\d\ds; "
                     r"total \d+m\d\ds\)", capsys.readouterr().err)
    # a rerun reuses the SFT model and the set, and finds the arms finished
    before = (out / "perfectible.jsonl").read_text()
    assert main(args) == 0
    assert (out / "perfectible.jsonl").read_text() == before
    assert "[sanity] 4/4 report (RL: 0 steps in" in capsys.readouterr().err


def test_sanity_config_layers_defaults_yaml_and_overrides(tmp_path):
    from unison.sanity import sanity_config

    p = tmp_path / "s.yaml"
    p.write_text('task:\n  template: "{problem} = ?"\n  truncated_reward: null\ntrain:\n  lr: 1e-5\n')
    c = sanity_config(str(p), ["train.steps=7"])
    assert (c.task.template, c.task.truncated_reward, c.train.lr, c.train.steps) == ("{problem} = ?", None, 1e-5, 7)
    assert c.sft.steps == 600 and c.task.train_size == 2000  # the built-in recipe underneath
    with pytest.raises(UnisonError, match="did you mean 'train.lr'"):
        sanity_config(None, ["train.lrr=1"])


def broken_lr(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["optim/lr"]


@pytest.mark.parametrize("regime,seeds,workers", [("stale", "0,1", "2"), ("nvfp4", "0", "1"),
                                                 pytest.param("int4", "0", "1", marks=pytest.mark.slow)])
def test_demo_end_to_end_small(tmp_path, capsys, sft_model, regime, seeds, workers):
    """`unison demo` (make demo): the precision arms, then part 2's clean, broken and cured runs on two seeds, two
    processes at a time (int4: GRPO and the same run quantization-aware; stale: K = 4 naive and with the
    mismatch-budget LR, each with its own engine worker process); one report with both tables, part 2 per seed and
    its mean, the curves, the ledger and the headline; a rerun reuses every arm."""
    import shutil

    out = tmp_path / "d"
    for part in ("precision", "collapse"):  # the module's warm start (the demo reuses a finished SFT)
        shutil.copytree(sft_model, out / part / "sft" / "model")
    args = ["demo", "--out", str(out), "--precisions", "fp32", "--k", "4", "--max-prompts", "8",
            "--collapse-prompts", "8", "--seeds", seeds, "--workers", workers, "--regime", regime, "--set", "train.steps=2",
            "--set", "train.prompts_per_step=4", "--set", "rollout.n=4", "--set", "checkpoint.every=0",
            "--set", "mismatch.decompose_every=1", "--set", "task.name=arithmetic", "--set", "train.mini_batches=1"]
    args += [x for kv in TASK for x in ("--set", kv)]
    assert main(args) == 0
    assert sorted(p.name for p in (out / "precision" / "arms").iterdir()) == ["fp32-grpo"]
    names = (["fp32-grpo-k0", "fp32-grpo-k4-tis-budget", "fp32-grpo-k4", "fp32-grpo-k4-tis"] if regime == "stale" else
             ["fp32-grpo", f"fp32-{regime}-grpo-qat", f"fp32-{regime}-grpo"])
    seed_list = [int(x) for x in seeds.split(",")]
    assert sorted(p.name for p in (out / "collapse" / "arms").iterdir()) == sorted(f"{n}-s{s}" for n in names
                                                                                   for s in seed_list)
    text = (out / "report.md").read_text()
    title = "samples 4 policy versions old" if regime == "stale" else f"{regime} rollout weights"
    assert f"{title}, GRPO training accuracy (last 10 steps), mean of {len(seed_list)} seed" in text
    assert "| seed | clean |" in text and "| mean |" in text
    if regime == "stale":  # the control: Token-TIS at the run's LR, no budget (constant LR, the correction on)
        assert "Token-TIS at the run's LR (control)" in text
        for s in seed_list:
            control = yaml_load(arms_dir(out) / f"fp32-grpo-k4-tis-s{s}" / "config.yaml")
            assert control["algo"] == "grpo_token_tis" and control["train"]["schedule"] == "constant"
            assert control["rollout"]["max_staleness"] == 4
    assert (out / "plots" / "collapse_and_cure.png").exists() and (out / "plots" / "ledger.png").exists()
    arms = out / "collapse" / "arms"
    for s in seed_list:
        cured = [json.loads(x) for x in (arms / f"{names[1]}-s{s}" / "metrics.jsonl").read_text().splitlines()]
        if regime != "stale":
            assert all(r["mismatch/k3"] < 1e-9 for r in cured)  # π is the policy μ samples from
        else:
            import yaml

            assert all("schedule/budget_factor" in r for r in cured)  # the LR follows the measured mismatch
            assert cured[0]["optim/lr"] == pytest.approx(0.1 * broken_lr(arms / f"{names[2]}-s{s}"))  # from 0.1×
            broken_cfg = yaml.safe_load((arms / f"{names[2]}-s{s}" / "config.yaml").read_text())
            assert broken_cfg["rollout"]["max_staleness"] == 4
    if len(seed_list) == 2:
        s0 = (arms / f"{names[2]}-s0" / "metrics.jsonl").read_text()
        s1 = (arms / f"{names[2]}-s1" / "metrics.jsonl").read_text()
        assert s0 != s1  # two seeds, two paths
    printed = capsys.readouterr().out
    assert f"mean of {len(seed_list)} seed" in printed
    # stdout is not a terminal here (as `make demo > log`): the table is sized to its content, no header cut to
    # "fin…" (issue 51, item 10)
    table = [line for line in printed.splitlines() if line.startswith(("┃", "│"))]
    assert table and not any("…" in line for line in table), printed[:2000]
    assert "final train acc" in printed and "steps to 95%" in printed
    assert main(args) == 0  # everything reused


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_demos_workers_die_with_it(tmp_path, sft_model):
    """`unison demo` sent SIGTERM alone (not its process group, as `kill PID` does) or SIGKILLed: its pool's
    worker processes, each running an arm, end with it instead of running on as orphans (they did)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "d"
    for part in ("precision", "collapse"):
        shutil.copytree(sft_model, out / part / "sft" / "model")
    cmd = [sys.executable, "-m", "unison", "demo", "--out", str(out), "--precisions", "fp32", "--k", "4",
           "--max-prompts", "8", "--collapse-prompts", "8", "--seeds", "0", "--workers", "2", "--regime", "int4",
           "--set", "train.steps=400", "--set", "train.prompts_per_step=4", "--set", "rollout.n=4",
           "--set", "checkpoint.every=0", "--set", "task.name=arithmetic", "--set", "train.mini_batches=1"]
    cmd += [x for kv in TASK for x in ("--set", kv)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any((out / "collapse" / "arms").glob("*/metrics.jsonl")):
            time.sleep(0.5)  # the workers are running arms
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGTERM)  # the demo alone
        proc.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(os.path.exists(f"/proc/{w}") for w in workers):
            time.sleep(0.2)
        left = [w for w in workers if os.path.exists(f"/proc/{w}")]
        assert not left, f"workers {left} outlived the demo"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def arms_dir(out):
    return out / "collapse" / "arms"


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())


def _seed(seed, clean, broken, cured, start=0.8, control=None):
    from unison.demo import judge_seed

    def rows(first, last):  # 10 steps at ``first`` then 10 at ``last``
        return [{"step": i + 1, "reward/mean": first if i < 10 else last} for i in range(20)]

    return judge_seed(seed, rows(clean, clean), rows(start, broken), rows(cured, cured),
                      control_rows=None if control is None else rows(0.5, control))


def test_demo_verdict_says_what_the_control_showed():
    """The stale regime's control (Token-TIS at the run's LR, no budget) is judged by the cure's rule (≥ 95% of the
    clean run: 0.95·0.88 = 0.836) and the verdict says which part decided: none of its seeds held -> the LR; all ->
    the budget's LR is not what cured it; some -> which seeds needed it. No control, no clause (int4)."""
    from unison.demo import REGIMES, headline_text, seed_table, verdict

    stale = REGIMES["stale"]
    lost = [_seed(0, 0.88, 0.1, 0.95, control=0.55), _seed(1, 0.88, 0.0, 0.96, control=0.83)]  # 0.83 < 0.836
    assert [p["control_held"] for p in lost] == [False, False] and lost[0]["control"] == pytest.approx(0.55)
    v = verdict(lost, stale)
    assert v.startswith("on every seed (2/2) the K = 4 run collapsed") and "cured it" in v
    assert v.endswith("Token-TIS alone at the run's LR (the control, no budget) did not (0/2 seeds at ≥ 95%): the "
                      "learning rate decided it — a constant low LR found by a search cures as well "
                      "(docs/experiments/demo_recipe.md)")
    held = [_seed(0, 0.88, 0.1, 0.95, control=0.90), _seed(1, 0.88, 0.0, 0.96, control=0.84)]
    assert verdict(held, stale).endswith("held as well (2/2): on these seeds the budget's LR is not what cured it")
    one = [_seed(0, 0.88, 0.1, 0.95, control=0.90), _seed(1, 0.88, 0.0, 0.96, control=0.5)]
    assert verdict(one, stale).endswith("held on 1/2 seeds (0): the budget's LR was needed on the others")
    h = headline_text(lost, stale)
    assert "the corrected run 0.96, the control 0.69, the clean run 0.88" in h  # (0.55 + 0.83) / 2 = 0.69
    assert "seed 0: 0.80 → 0.10, cured 0.95, control 0.55, clean 0.88" in h
    table = seed_table(lost, stale)
    assert "control / clean" in table[0] and table[1].count("---") == 9
    assert "| 0.550 | 62% |" in table[2]  # 0.55 / 0.88 = 0.6249… in floats -> 62%
    assert "| 0.690 | 78% |" in table[-1]  # the mean row: 0.69 / 0.88 = 78.4%
    plain = [_seed(0, 0.88, 0.56, 0.87)]
    assert "control" not in plain[0] and "control" not in verdict(plain) and "control" not in seed_table(plain)[0]


def test_demo_verdict_claims_a_cure_only_when_it_held_on_every_seed():
    """Per seed: a collapse ends below 80% of the clean run, a cure at 95% of it or above (0.8·0.88 = 0.704,
    0.95·0.88 = 0.836). The cure is claimed only when every seed collapsed and every cure held."""
    from unison.demo import REGIMES, verdict

    p = _seed(0, 0.88, 0.56, 0.87)
    assert (p["broken_start"], p["broken"]) == pytest.approx((0.8, 0.56)) and p["collapsed"] and p["cure_held"]
    cured_all = [_seed(0, 0.88, 0.56, 0.87), _seed(1, 0.90, 0.40, 0.90)]
    assert verdict(cured_all) == ("on every seed (2/2) the int4 run collapsed, and computing the learner through the "
                                  "rollout's quantizer (train.quantization_aware=true) cured it (≥ 95% of the clean run)")
    assert verdict(cured_all, REGIMES["stale"]).startswith("on every seed (2/2) the K = 4 run collapsed, and the "
                                                           "off-policy correction (Token-TIS) with the learning rate")
    some = [_seed(0, 0.88, 0.56, 0.87), _seed(1, 0.88, 0.56, 0.80)]  # 0.80 < 0.836: not cured on seed 1
    v = verdict(some)
    assert v.startswith("the int4 run collapsed on 2/2 seeds (0, 1); the quantization-aware run held on 1 of them (0)")
    assert "ended below 95% of the clean run on seed 1" in v and v.endswith("no cure is claimed (it must hold on every seed)")
    assert "cured it" not in v
    none = [_seed(0, 0.88, 0.75, 0.87), _seed(1, 0.88, 0.71, 0.87)]  # 0.71 >= 0.704: no collapse
    assert verdict(none).startswith("the int4 run did not collapse on any of the 2 seeds")
    one = [_seed(0, 0.88, 0.56, 0.87), _seed(1, 0.88, 0.80, 0.87)]  # seed 1 did not collapse
    assert verdict(one).startswith("the int4 run collapsed on 1/2 seeds (0); the quantization-aware run held on 1 of them (0)")
    assert "no cure is claimed" in verdict(one)
    both = [_seed(0, 0.88, 0.56, 0.60), _seed(1, 0.88, 0.50, 0.87)]  # seed 0: the cure fell too (0.60 < 0.704)
    v = verdict(both)
    assert "the quantization-aware run ended below 80% of the clean run as well on seed 0" in v and "held on 1 of them (1)" in v and "no cure is claimed" in v
    assert "the corrected run held on 1 of them (1)" in verdict(both, REGIMES["stale"])
