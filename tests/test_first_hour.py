"""What a new user hits in the first hour (issue 22): each behaviour, tested as that user would meet it."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unison import checkpoint as ckpt
from unison.cli import main
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=1e-3", "log.console=false",
        "log.tensorboard=false"]



# 1 ------------------------------------------------------------------------------------------------
def test_a_reward_that_always_raises_stops_the_run_even_when_most_responses_are_truncated(tmp_path, module_dir):
    # 6 new tokens from a random model: most responses are cut and score truncated_reward without a call
    cfg = load_config(None, BASE + ["task.reward=rewards:always", "train.steps=8"])
    t = Trainer(cfg, tmp_path / "r", log=lambda m: None)
    with pytest.raises(UnisonError, match=r"every call of the reward function rewards:always raised for 3 "
                                          r"consecutive steps \(last: ValueError: no answer field\)"):
        t.fit()
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert all(r["reward/error_count"] == r["reward/calls"] for r in rows)
    assert sum(r["reward/calls"] for r in rows) < 16 * len(rows) / 2  # most responses made no call
    assert all(r["reward/error_fraction"] == 1.0 for r in rows if r["reward/calls"])  # not diluted


# 2 ------------------------------------------------------------------------------------------------
def test_a_run_with_no_learning_signal_says_so_once(tmp_path, module_dir):
    logs = []
    cfg = load_config(None, BASE + ["task.reward=rewards:zero", "train.steps=5", "train.no_signal_steps=3",
                                    "log.console=true"])
    Trainer(cfg, tmp_path / "r", log=logs.append).fit()
    warned = [m for m in logs if "nothing is being learned" in m]
    assert len(warned) == 1 and "for 3 steps every group's rewards were equal" in warned[0]
    assert "rollout.max_new_tokens" in warned[0] or "unison filter" in warned[0]
    assert any(" trunc " in m for m in logs if m.startswith("[train] step"))  # the truncated fraction is shown


# 3 ------------------------------------------------------------------------------------------------
RUN = textwrap.dedent("""
    import sys
    from unison.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130),  # SIGTERM's 143 also: test_async.py, test_faults.py
                                      pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path, module_dir, sig, code):
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("task:\n  reward: rewards:length\n  truncated_reward: null\n")
    script = tmp_path / "run.py"
    script.write_text(RUN)
    sets = [f"--set={s}" for s in BASE + ["train.steps=300", "log.console=true"]]
    env = {**os.environ, "PYTHONPATH": str(module_dir) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(script), "train", str(cfgfile), "--out", str(tmp_path / "run"),
                             *sets], stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if line.startswith("[train] step 2/300"):
            proc.send_signal(sig)
            break
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == code, rest
    assert "Traceback" not in rest and rest.count("unison: stopped by") == 1
    done = ckpt.complete(tmp_path / "run" / "checkpoints")
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert done and done[-1].name == f"step_{steps[-1]:06d}"
    # --resume without the config: the run's own config.yaml is read
    again = subprocess.run([sys.executable, str(script), "train", "--out", str(tmp_path / "run"), "--resume",
                            "--set", "train.steps=" + str(steps[-1] + 1)], capture_output=True, text=True, env=env,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, steps[-1] + 2))


def test_the_start_up_line_gives_the_checkpoint_size_and_policy(tmp_path, module_dir):
    logs = []
    Trainer(load_config(None, BASE + ["train.steps=1"]), tmp_path / "r", log=logs.append)
    line = next(m for m in logs if m.startswith("[train] checkpoints:"))
    assert "every 10 min" in line and "GiB each" in line and "2 kept" in line


# 4 ------------------------------------------------------------------------------------------------
def test_a_refused_resume_names_every_differing_key(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", str(_cfg(tmp_path)), "--out", str(run)] + [f"--set={s}" for s in BASE + ["train.steps=1"]]
    assert main(args) == 0
    assert main(args + ["--set", "seed=5", "--set", "train.lr=0.5", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "seed (0 -> 5)" in err and "train.lr (0.001 -> 0.5)" in err


def test_a_run_that_failed_before_its_first_step_can_be_restarted_in_place(tmp_path, module_dir, capsys):
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in BASE + ["train.steps=1"]]
    cfg = _cfg(tmp_path)
    # a reward that raises at import time fails at start-up; a run directory left by a failure in step 1:
    (module_dir / "broken.py").write_text("def reward(r, i):\n    raise RuntimeError('boom')\n")
    assert main(["train", str(cfg), "--out", str(run), *sets, "--set", "task.reward=broken:reward",
                 "--set", "task.truncated_reward=null", "--set", "task.reward_error_patience=1"]) == 2
    assert (run / "config.yaml").exists() and not ckpt.complete(run / "checkpoints")
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(run), *sets]) == 0  # no --resume, no new --out


def test_train_without_a_config_or_resume_says_what_to_pass(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r")]) == 2
    assert "needs a CONFIG" in capsys.readouterr().err


def _cfg(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("{}\n")
    return p


# 5 ------------------------------------------------------------------------------------------------
def test_the_tasks_page_custom_task_example_runs_as_written(tmp_path):
    """From another directory, without PYTHONPATH: the reward module and the data are found next to the config."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "unison", "train", str(ROOT / "examples/custom_task/config.yaml"),
                          "--out", str(tmp_path / "custom"), "--set", "train.steps=2"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = read_metrics(tmp_path / "custom" / "metrics.jsonl")
    assert len(rows) == 2 and rows[0]["reward/calls"] == 64 and rows[0]["reward/error_count"] == 0
    saved = (tmp_path / "custom" / "config.yaml").read_text()
    assert str(ROOT / "examples/custom_task/reward.py") in saved  # found again on --resume


def test_jsonl_rows_reach_the_reward_with_every_field(tmp_path):
    from unison.tasks import make_task
    from unison.config import TaskConfig

    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "2+2=", "answer": 4, "topic": "sums"}\n{"prompt": "Hi", "hint": "greet"}\n')
    task = make_task(TaskConfig(name="jsonl", path=str(data), reward="x:y", eval_size=0))
    items = sorted(task.train, key=lambda it: it.prompt)
    assert [it.prompt for it in items] == ["2+2=", "Hi"]
    assert items[0]["answer"] == 4 and items[0].answer == "4" and items[0]["topic"] == "sums"
    assert items[1].answer == "" and items[1].get("hint") == "greet" and "hint" in items[1]
    with pytest.raises(KeyError, match="this item's fields are"):
        items[1]["answer_key"]
    templated = make_task(TaskConfig(name="jsonl", path=str(data), reward="x:y", eval_size=0,
                                     template="Q: {prompt}\nA:"))
    assert sorted(it.prompt for it in templated.train) == ["Q: 2+2=\nA:", "Q: Hi\nA:"]
    with pytest.raises(UnisonError, match="task.reward is not set"):
        make_task(TaskConfig(name="jsonl", path=str(data)))


def test_a_template_given_with_set_is_a_string_and_the_math_template_is_printed(tmp_path):
    cfg = load_config(None, ["task.template={problem}"])
    assert cfg.task.template == "{problem}"
    logs = []
    Trainer(load_config(None, BASE + ["task.name=math", "task.path=builtin:aime2024", "train.steps=1",
                                      "train.prompts_per_step=4", "task.template=Solve: {problem}"]),
            tmp_path / "r", log=logs.append)
    assert any("math prompts: task.template 'Solve: {problem}'" in m for m in logs)
    assert any("no chat template" in m for m in logs)


# 6 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,rows", [("sanity_math", 1460), ("math500", 500), ("aime2024", 30), ("amc23", 83)])
def test_the_papers_data_ships_with_the_package(name, rows):
    from unison.data_io import read_jsonl

    assert len(read_jsonl(f"builtin:{name}", {"problem": str})) == rows


def test_an_unknown_shipped_set_suggests_the_nearest():
    from unison.data_io import resolve_data_path

    with pytest.raises(UnisonError, match="did you mean 'builtin:math500'"):
        resolve_data_path("builtin:math50")


# 7 ------------------------------------------------------------------------------------------------
def test_report_names_runs_by_directory_and_says_when_a_line_is_torn(tmp_path, capsys):
    for name in ("alpha", "beta"):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text("precision: bf16\nalgo: grpo\n")  # same precision and algo
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.25}) + "\n"
                                         + ('{"step": 2, "rew' if name == "beta" else ""))
    assert main(["report", str(tmp_path / "alpha"), str(tmp_path / "beta"), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr()
    assert "alpha" in out.out and "beta" in out.out and "sanity test" not in out.out
    assert out.err.count("cut short") == 1 and "beta/metrics.jsonl:2" in out.err
    assert "| alpha |" in (tmp_path / "rep" / "report.md").read_text()


def test_report_help_shows_a_plain_percent(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    assert "95%" in out and "95%%" not in out


def test_the_done_line_rounds_its_numbers(tmp_path, capsys):
    assert main(["train", str(_cfg(tmp_path)), "--out", str(tmp_path / "r")] +
                [f"--set={s}" for s in BASE + ["train.steps=1"]]) == 0
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: 1 step, reward 0.000 -> 0.000 (last-5 mean 0.000)"), done


# 8 ------------------------------------------------------------------------------------------------
def test_hints_point_the_right_way(tmp_path):
    with pytest.raises(UnisonError, match="did you mean 'builtin:smollm2'"):
        load_config(None, ["model=smollm2"]) and Trainer(load_config(None, ["model=smollm2"]), tmp_path / "r")
    with pytest.raises(UnisonError, match=r"runs/demo/sft/model"):
        Trainer(load_config(None, ["model=runs/nope/model"]), tmp_path / "r")
