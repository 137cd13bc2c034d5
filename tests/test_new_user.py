"""A new user on a busy machine (issue 32): threads, paths, truncated responses, held-out rows, the
messages at the end of a run, unknown characters, the start-up line, and the smaller hints."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from unison import threads
from unison.cli import main
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.micro_batch_size=8", "train.lr=1e-3", "log.console=false",
        "log.tensorboard=false"]


@pytest.fixture()
def rewards(module_dir):
    return module_dir


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


# 1. threads --------------------------------------------------------------------------------------
def test_threads_setting_is_auto_or_a_positive_integer():
    assert load_config(None, []).threads == "auto"
    assert load_config(None, ["threads=3"]).threads == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(UnisonError, match="threads '.*' is not auto or a positive integer"):
            load_config(None, [f"threads={bad}"])


def test_auto_takes_the_idle_cores_of_a_model_that_scales(monkeypatch):
    for k in threads.ENV_KEYS + ("LOCAL_WORLD_SIZE",):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(threads, "_torch_untouched", True)  # as on the command line
    monkeypatch.setattr(threads, "usable_cores", lambda: (4, [0, 1, 2, 3]))
    big = 135_000_000
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 3.9)
    t = threads.decide("auto", params=big)
    assert (t.n, t.reason) == (4, "auto: 4 cores idle, a 135.0M-parameter model")
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 2.8)  # one CPU-bound job beside us
    t = threads.decide("auto", params=big)
    assert t.n == 3 and "1.2 of them busy with other processes" in t.reason
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 0.2)  # everything busy: still one thread
    assert threads.decide("auto", params=big).n == 1
    # the tiny model: one thread, without sampling the machine
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: pytest.fail("sampled the load for a tiny model"))
    t = threads.decide("auto", params=800_000)
    assert t.n == 1 and "0.8M-parameter model's ops are too small" in t.reason
    # an explicit count is taken as given, and said to be more than the cores when it is
    assert str(threads.decide(8, params=big)) == "threads 8 (threads: 8; more than the 4 cores)"


def test_auto_honours_the_users_environment_but_not_torchruns_default(monkeypatch):
    monkeypatch.setattr(threads, "_torch_untouched", True)
    monkeypatch.setattr(threads, "usable_cores", lambda: (8, list(range(8))))
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 8.0)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert str(threads.decide("auto", params=10**8)) == "threads 3 (OMP_NUM_THREADS=3)"
    assert threads.decide(2, params=10**8).n == 2  # the config key wins over the environment
    # torchrun sets OMP_NUM_THREADS=1 for several local ranks: the node's cores are divided instead
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert str(threads.decide("auto", params=10**8)) == "threads 2 (auto: 8 cores / 4 local ranks)"


def test_auto_honours_torch_set_num_threads_made_by_the_calling_program(monkeypatch):
    for k in threads.ENV_KEYS + ("LOCAL_WORLD_SIZE",):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(threads, "_torch_untouched", False)  # a user's script imported torch first
    monkeypatch.setattr(threads, "_applied", None)
    default = threads._physical_cores(threads.usable_cores()[1])
    torch.set_num_threads(default + 1)
    assert str(threads.decide("auto", params=10**8)) == f"threads {default + 1} (torch.set_num_threads({default + 1}))"
    threads.give(default + 1)  # set by unison itself: not the user's choice
    assert "torch.set_num_threads" not in threads.decide("auto", params=800_000).reason


def test_idle_cores_sees_a_busy_process_on_its_core():
    cpu = sorted(os.sched_getaffinity(0))[0]
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)
        assert threads.idle_cores([cpu]) < 0.5
    finally:
        busy.kill()
        busy.wait()


def test_the_command_line_makes_waiting_threads_sleep_unless_the_user_chose(monkeypatch):
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(k, raising=False)
    threads.prepare_environment()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    threads.prepare_environment()
    assert "OMP_WAIT_POLICY" not in os.environ
    # what `python -m unison` does first: torch is not imported yet, so libgomp reads the policy when it loads
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import unison.cli, unison.threads as t; t.prepare_environment(); import os, torch; "
            "print(os.environ['OMP_WAIT_POLICY'], t._torch_untouched)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["PASSIVE", "True"], out.stderr


def test_the_start_up_line_says_the_thread_count_and_why(tmp_path, capsys, monkeypatch):
    for k in threads.ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(threads, "_applied", torch.get_num_threads())  # this process's count is not a user's
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    args = ["train", str(cfg), "--out", str(tmp_path / "r")] + [f"--set={s}" for s in BASE + ["train.steps=1"]]
    assert main(args) == 0
    assert "threads 1 (auto: a 0.8M-parameter model's ops are too small to gain from more threads)" \
        in capsys.readouterr().err
    # --threads wins over the config, and a resume may change it
    torch.set_num_threads(2)
    assert main(["train", "--out", str(tmp_path / "r"), "--resume", "--set=train.steps=2", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "threads 1 (threads: 1)" in err and torch.get_num_threads() == 1


def test_the_async_worker_and_the_learner_split_the_runs_threads(tmp_path):
    t = Trainer(load_config(None, BASE + ["train.steps=1", "rollout.max_staleness=1", "threads=3"]),
                tmp_path / "r", log=lambda m: None)
    try:
        assert t.source.backend.worker.proc.is_alive()
        assert t.source.backend.trainer_threads == 2 and torch.get_num_threads() == 2  # the worker takes 1
    finally:
        t.source.close()


# 2. paths ----------------------------------------------------------------------------------------
def test_a_data_path_resolves_next_to_the_config_first(tmp_path, monkeypatch):
    here, there = tmp_path / "project", tmp_path / "elsewhere"
    here.mkdir()
    there.mkdir()
    _jsonl(here / "data.jsonl", 36)
    _jsonl(there / "data.jsonl", 3)  # a same-named file in the working directory
    (here / "reward.py").write_text("def reward(r, item):\n    return 0.0\n")
    (here / "config.yaml").write_text("task:\n  name: jsonl\n  path: data.jsonl\n  reward: reward:reward\n")
    monkeypatch.chdir(there)
    cfg = load_config(here / "config.yaml")
    assert cfg.task.path == str(here / "data.jsonl") and cfg.task.reward == f"{here / 'reward.py'}:reward"
    from unison.tasks import make_task

    assert len(make_task(cfg.task, evaluate=False).train) == 36
    # given on the command line, the working directory comes first
    assert load_config(here / "config.yaml", ["task.path=data.jsonl"]).task.path == str(there / "data.jsonl")


def test_the_saved_config_holds_absolute_paths_and_resume_works_from_any_directory(tmp_path, monkeypatch):
    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    _jsonl(work / "sums.jsonl", 12)
    monkeypatch.chdir(work)
    sets = [f"--set={s}" for s in BASE + ["task.path=sums.jsonl", "train.steps=1"]]
    assert main(["train", str(_empty(work)), "--out", "run", *sets]) == 0
    saved = (work / "run" / "config.yaml").read_text()
    assert f"path: {work / 'sums.jsonl'}" in saved
    monkeypatch.chdir(other)
    assert main(["train", "--out", str(work / "run"), "--resume", "--set", "train.steps=2"]) == 0
    assert [r["step"] for r in read_metrics(work / "run" / "metrics.jsonl")] == [1, 2]


def _empty(d: Path) -> Path:
    (d / "c.yaml").write_text("{}\n")
    return d / "c.yaml"


# 3. truncated responses with a custom reward ------------------------------------------------------
def test_a_custom_reward_is_told_that_cut_responses_score_zero_and_warned_once_when_most_are(tmp_path, rewards):
    logs = []
    # 6 new tokens from a random model: nearly every response is cut
    Trainer(load_config(None, BASE + ["task.reward=rewards:length", "train.steps=2"]), tmp_path / "a",
            log=logs.append).fit()
    assert sum("scores task.truncated_reward=0 without a call of your reward (rewards:length)" in m
               for m in logs) == 1
    warned = [m for m in logs if "of the responses hit rollout.max_new_tokens=6" in m]
    assert len(warned) == 1 and "task.truncated_reward=null" in warned[0] and "WARNING step 1" in warned[0]
    logs.clear()
    Trainer(load_config(None, BASE + ["task.reward=rewards:length", "task.truncated_reward=null", "train.steps=2"]),
            tmp_path / "b", log=logs.append).fit()
    assert not [m for m in logs if "truncated_reward" in m]


# 4. jsonl holds nothing out unless an eval is asked for --------------------------------------------
def test_a_jsonl_task_trains_on_every_row_unless_an_eval_is_asked_for(tmp_path, rewards):
    data = _jsonl(tmp_path / "d.jsonl", 20)
    sets = BASE + ["task.name=jsonl", f"task.path={data}", "task.reward=rewards:zero", "train.steps=1"]
    t = Trainer(load_config(None, sets), tmp_path / "a", log=lambda m: None)
    assert (len(t.task.train), len(t.task.eval)) == (20, 0)
    t = Trainer(load_config(None, sets + ["train.eval_every=5"]), tmp_path / "b", log=lambda m: None)
    assert (len(t.task.train), len(t.task.eval)) == (18, 2)


# 6. the reward-error stop, the no-signal warning, the done line ------------------------------------
def test_the_reward_error_stop_says_where_to_continue_from(tmp_path, rewards):
    sets = BASE + ["task.reward=rewards:always", "task.truncated_reward=null", "task.reward_error_patience=2",
                   "train.steps=5", "checkpoint.every_minutes=0"]
    with pytest.raises(UnisonError) as no_checkpoint:
        Trainer(load_config(None, sets), tmp_path / "a", log=lambda m: None).fit()
    assert "no checkpoint was saved yet" in str(no_checkpoint.value) and "last checkpoint" not in str(no_checkpoint.value)
    with pytest.raises(UnisonError) as saved:
        Trainer(load_config(None, sets + ["checkpoint.every=1"]), tmp_path / "b", log=lambda m: None).fit()
    assert "continue with --resume from the last checkpoint (step_000001)" in str(saved.value)


def test_the_no_signal_warning_blames_truncation_only_when_cut_responses_were_not_graded(tmp_path, rewards):
    sets = BASE + ["task.reward=rewards:zero", "train.steps=3", "train.no_signal_steps=3"]
    for graded, name in ((False, "a"), (True, "b")):
        logs = []
        Trainer(load_config(None, sets + (["task.truncated_reward=null"] if graded else [])), tmp_path / name,
                log=logs.append).fit()
        warned = [m for m in logs if "nothing is being learned" in m]
        assert len(warned) == 1
        assert ("raise rollout.max_new_tokens" in warned[0]) is not graded, warned[0]


def test_the_done_line_names_reward_errors_and_steps_without_signal(tmp_path, rewards, capsys):
    args = ["train", str(_empty(tmp_path)), "--out", str(tmp_path / "r")] + \
        [f"--set={s}" for s in BASE + ["task.reward=rewards:always", "task.truncated_reward=null",
                                       "task.reward_error_patience=0", "train.steps=2"]]
    assert main(args) == 0
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"done: 2 steps, reward 0\.000 -> 0\.000 \(last-5 mean 0\.000\); 32 reward errors, "
                    r"2 steps without a learning signal; run in ", done), done
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["reward_errors"] == 32 and summary["no_signal_steps"] == 2


# 9. characters the tokenizer does not know -------------------------------------------------------
def test_characters_the_tiny_tokenizer_drops_are_named_once(tmp_path, rewards):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "3×4? Ü"}\n{"prompt": "5×6?"}\n{"prompt": "plain"}\n{"prompt": "also plain"}\n')
    logs = []
    Trainer(load_config(None, BASE + ["task.name=jsonl", f"task.path={data}", "task.reward=rewards:zero",
                                      "train.steps=1"]), tmp_path / "r", log=logs.append)
    warned = [m for m in logs if "no token for" in m]
    assert len(warned) == 1
    assert "2 characters in 2 of 4 prompts: '×' (U+00D7), 'Ü' (U+00DC)" in warned[0]
    from unison.models import builtin_model_dir, load_tokenizer, unknown_characters

    assert unknown_characters(load_tokenizer(builtin_model_dir("tiny")), ["12+35=", "Q: (a)?\n"]) is None


# 12. the start-up line ---------------------------------------------------------------------------
def test_the_start_up_line_names_algorithm_lora_packing_and_truncated_sampling(tmp_path):
    logs = []
    Trainer(load_config(None, BASE + ["train.steps=1", "algo=grpo_token_tis", "lora.rank=2", "train.packing=true",
                                      "rollout.top_p=0.9", "rollout.top_k=20"]), tmp_path / "a", log=logs.append)
    line = next(m for m in logs if m.startswith("[train] algo "))
    assert line.startswith("[train] algo grpo_token_tis (advantage drgrpo, loss ppo_clip, correction token_tis")
    assert "LoRA rank 2" in line and "checkpoints hold the adapters" in line
    assert "packing on" in line and "top-p 0.9 and top-k 20" in line and "renormalises π over the same support" in line
    logs.clear()
    Trainer(load_config(None, BASE + ["train.steps=1", "rollout.top_p=0.9", "rollout.replay_sampling_mask=false"]),
            tmp_path / "c", log=logs.append)
    assert "adds −log(kept mass) to the mismatch" in next(m for m in logs if m.startswith("[train] algo "))
    logs.clear()
    Trainer(load_config(None, BASE + ["train.steps=1"]), tmp_path / "b", log=logs.append)
    line = next(m for m in logs if m.startswith("[train] algo "))
    assert "full fine-tuning" in line and "packing off" in line and "from the full distribution" in line


# 13. the smaller hints ---------------------------------------------------------------------------
def test_a_yaml_syntax_error_gives_its_line(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("train:\n  steps: 3\n lr: 1e-4\n")
    with pytest.raises(UnisonError, match=r"c.yaml' is not valid YAML at line 3, column 2"):
        load_config(bad)


def test_hints_for_fp8_precision_and_a_model_file(tmp_path):
    with pytest.raises(UnisonError, match="set rollout.quantization=fp8"):
        load_config(None, ["precision=fp8"])
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(UnisonError, match=r"is a file, not a directory: .*\.gguf"):
        Trainer(load_config(None, [f"model={weights}"]), tmp_path / "r")


def test_probe_help_names_the_builtin_models(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "builtin:tiny or builtin:smollm2" in out and "--threads" in out


def test_the_int4_warning_quotes_the_quantized_rollout_pages_probe_table():
    from unison.algorithms.presets import resolve_policy
    from unison.config import PolicyConfig
    from unison.quant import quantization_warning

    page = (ROOT / "docs/quantized-rollout.md").read_text(encoding="utf-8")
    int4 = re.findall(r"\| fp32 \| int4 \| \d+ \| \*\*([0-9.]+)\*\* \|", page)
    assert len(int4) == 2  # the tiny model's row, then SmolLM2's
    msg = quantization_warning("int4", resolve_policy("grpo", PolicyConfig()))
    assert f"{int4[0]} on the built-in tiny model and {int4[1]} on SmolLM2-135M" in msg


def test_the_report_says_reward_for_a_reward_that_is_not_binary(tmp_path):
    from unison.report import markdown_table, summarize, write_report

    for name, task in (("acc", "name: arithmetic"), ("own", "name: jsonl\n  reward: rewards:length")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(f"task:\n  {task}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward/mean": 0.1 * i}) + "\n"
                                                 for i in range(6)))
    assert "| initial acc | final train acc |" in markdown_table([summarize(tmp_path / "acc")])
    assert "| initial reward | final reward |" in markdown_table([summarize(tmp_path / "own")])
    text = write_report([tmp_path / "own"], tmp_path / "rep").read_text()
    assert "over the first / last 5 steps" in text and "not an accuracy" in text


# 11. the custom-task example learns ----------------------------------------------------------------
@pytest.mark.slow
def test_the_custom_task_example_climbs(tmp_path):
    """docs/tasks.md's example, as written (30 steps of the tiny model, ≈ 45 s): its reward climbs."""
    assert main(["train", str(ROOT / "examples/custom_task/config.yaml"), "--out", str(tmp_path / "r"),
                 "--set", "log.console=false", "--set", "log.tensorboard=false"]) == 0
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rewards) == 30 and last > 2 * first and last > 0.25, rewards


def test_beside_busy_spins_cores_while_the_command_runs_and_stops_them_after(tmp_path):
    # scripts/beside_busy.py: how `make test` is checked beside two CPU-bound processes (docs/testing.md)
    script = ROOT / "scripts" / "beside_busy.py"
    check = ("import os, sys; pids = [int(p) for p in os.environ['BESIDE_BUSY_PIDS'].split(',')];"
             " busy = [p for p in pids if 'while True' in open(f'/proc/{p}/cmdline').read()];"
             " print(','.join(map(str, pids))); sys.exit(10 + len(busy))")
    r = subprocess.run([sys.executable, str(script), "--busy", "2", "--runs", "2", "--out", str(tmp_path / "rows.json"),
                        "--", sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert r.returncode == 12 and [x["rc"] for x in rows] == [12, 12], r.stdout + r.stderr  # two, alive, beside it
    pids = [int(p) for p in r.stdout.splitlines()[0].split(",")]
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "a busy process outlived the script"
    bad = subprocess.run([sys.executable, str(script), "--busy", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == ("beside_busy: no command given: put it after --, "
                                                          "e.g. -- make test")
