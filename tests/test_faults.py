"""Faults during a run (issue 13): damaged checkpoints, torn metrics, failing rewards, kills at
any point, and accounting that tells the truth (mini-batch count, what reward/mean averages)."""

import os
import subprocess
import sys
import textwrap

import pytest

from unison import checkpoint as ckpt
from unison.cli import main
from unison.config import load_config
from unison.data_io import read_metrics
from unison.errors import UnisonError
from unison.trainer import Trainer

BASE = ["task.digits=1", "task.train_size=40", "task.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=6",
        "train.prompts_per_step=4", "train.mini_batches=2", "train.micro_batch_size=8", "train.lr=1e-3",
        "log.console=false", "log.tensorboard=false", "task.reward=char_reward:reward", "task.truncated_reward=null"]
REWARD = "def reward(response, item):\n    return len(response) / 10\n"


@pytest.fixture()
def rewards(tmp_path, monkeypatch):
    (tmp_path / "char_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))} for r in rows]


def _run(tmp_path, name, steps, extra=(), resume=False):
    cfg = load_config(None, BASE + [f"train.steps={steps}", "checkpoint.every=1", *extra])
    return Trainer(cfg, tmp_path / name, resume=resume, log=lambda m: None).fit()


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, rewards):
    _run(tmp_path, "full", 4)
    _run(tmp_path, "run", 3)
    ck = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpt.complete(ck)] == ["step_000002", "step_000003"]  # keep 2
    state = ck / "step_000003" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    logs = []
    cfg = load_config(None, BASE + ["train.steps=4", "checkpoint.every=1"])
    t = Trainer(cfg, tmp_path / "run", resume=True, log=logs.append)
    assert t.step == 2
    assert any("checkpoint step_000003 is damaged (trainer_state.pt has 100 bytes" in m
               and "falling back to step_000002" in m for m in logs), logs
    t.fit()
    assert _comparable(read_metrics(tmp_path / "run/metrics.jsonl")) == \
        _comparable(read_metrics(tmp_path / "full/metrics.jsonl"))


def test_no_usable_checkpoint_is_refused_without_touching_the_run(tmp_path, rewards, capsys):
    _run(tmp_path, "run", 2)
    run = tmp_path / "run"
    for c in ckpt.complete(run / "checkpoints"):
        (c / "optimizer" / ".metadata").write_bytes(b"garbage")
    before = _tree(run)
    cfgfile = tmp_path / "cfg" / "c.yaml"  # not beside the reward module (that would record its path)
    cfgfile.parent.mkdir()
    cfgfile.write_text("seed: 0\n")
    argv = ["train", str(cfgfile), "--out", str(run), "--resume"] + [f"--set={s}" for s in
                                                                   BASE + ["train.steps=3", "checkpoint.every=1"]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("unison: error: --resume: no usable checkpoint") and "Traceback" not in "".join(err)
    assert _tree(run) == before  # config.yaml, metrics, checkpoints: byte for byte


def test_a_torn_last_metrics_line_is_dropped_on_resume_and_in_reports(tmp_path, rewards, capsys):
    _run(tmp_path, "full", 3)
    _run(tmp_path, "run", 2)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 3, "reward/mean": 0.5, "mism')  # the trace of a SIGKILL mid-write
    assert main(["report", str(tmp_path / "run")]) == 0
    _run(tmp_path, "run", 3, resume=True)
    assert _comparable(read_metrics(metrics)) == _comparable(read_metrics(tmp_path / "full/metrics.jsonl"))


def test_failing_rewards_are_shown_warned_and_stop_the_run(tmp_path, monkeypatch):
    (tmp_path / "bad_reward.py").write_text(textwrap.dedent("""
        def always(response, item):
            raise ValueError("no answer field")
        calls = [0]
        def half(response, item):
            calls[0] += 1
            if calls[0] % 2:
                raise KeyError("sometimes")
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    logs = []
    cfg = load_config(None, BASE + ["task.reward=bad_reward:half", "train.steps=2", "log.console=true"])
    Trainer(cfg, tmp_path / "half", log=logs.append).fit()
    rows = read_metrics(tmp_path / "half" / "metrics.jsonl")
    assert [r["reward/error_count"] for r in rows] == [8, 8] and rows[0]["reward/error_fraction"] == 0.5
    assert any(m.startswith("[train] WARNING step 1: 8 of 16 rewards raised") and "KeyError" in m for m in logs)
    assert any("reward-errors 8" in m for m in logs if m.startswith("[train] step"))  # on the console line
    cfg = load_config(None, BASE + ["task.reward=bad_reward:always", "train.steps=5", "checkpoint.every=1"])
    t = Trainer(cfg, tmp_path / "always", log=lambda m: None)
    with pytest.raises(UnisonError, match=r"every call of the reward function bad_reward:always raised for 3 "
                                          r"consecutive steps \(last: ValueError: no answer field\)"):
        t.fit()
    done = ckpt.complete(tmp_path / "always" / "checkpoints")
    assert [p.name for p in done] == ["step_000001", "step_000002"] and ckpt.verify(done[-1]) is None


@pytest.mark.parametrize("prompts,n", [(3, 2), (3, 3)])
def test_the_batch_is_split_into_exactly_the_configured_mini_batches(tmp_path, rewards, prompts, n):
    # torch.chunk(4) makes 3 chunks of 6 or 9 rows; the split must give 4 optimizer steps
    cfg = load_config(None, BASE + ["train.steps=1", f"train.prompts_per_step={prompts}", f"rollout.n={n}",
                                    "train.mini_batches=4"])
    m = Trainer(cfg, tmp_path / "r", log=lambda m: None).train_step()
    assert m["optim/steps"] == 4


def test_reward_mean_counts_everything_sampled_and_the_batch_is_trimmed(tmp_path, monkeypatch):
    # prompts of one shape always earn 1 (uniform groups, dropped by DAPO), the others vary
    (tmp_path / "mixed.py").write_text(textwrap.dedent("""
        def reward(response, item):
            if item.prompt.startswith(("1", "2", "3", "4", "5")):
                return 1.0
            return len(response) / 10
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, BASE + ["task.reward=mixed:reward", "train.steps=1", "train.drop_uniform_groups=true",
                                    "train.oversample_rounds=3"])
    t = Trainer(cfg, tmp_path / "r", log=lambda m: None)
    roll = t.source.next(0)
    comps, rewards, sampled = roll.completions, roll.rewards, roll.sampled_rewards
    assert len(comps) == 16 and len(sampled) == 16 * roll.rounds  # trimmed back to 4 prompts x 4
    assert roll.dropped_groups > 0 and len({c.prompt_index for c in comps}) == 4
    t2 = Trainer(cfg, tmp_path / "r2", log=lambda m: None)
    m = t2.train_step()
    assert m["reward/mean"] == pytest.approx(sum(sampled) / len(sampled))  # everything sampled
    assert m["reward/trained_mean"] == pytest.approx(sum(rewards) / len(rewards))  # what was trained on
    assert m["reward/mean"] > m["reward/trained_mean"]  # the all-correct groups count in the accuracy


KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from unison.config import load_config
    from unison.trainer import Trainer
    point, out = sys.argv[1], sys.argv[2]
    base = {base!r}
    cfg = load_config(None, base + ["train.steps=5", "checkpoint.every=2"])
    t = Trainer(cfg, out, resume=os.path.exists(out), log=lambda m: None)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if point == "rollout":            # mid-step, inside generation at step 3
        gen = t.engine.generate
        t.engine.generate = lambda p, s: die() if t.step == 2 else gen(p, s)
    elif point == "update":           # inside the optimizer update of step 4
        tr = t.learner.train
        t.learner.train = lambda *a, **k: die() if t.step == 3 else tr(*a, **k)
    elif point == "checkpoint-weights":   # right after the step-4 checkpoint wrote its model
        import unison.checkpoint as C
        sm = C.save_model
        C.save_model = lambda l, p, tok: (sm(l, p, tok), die()) if t.step == 4 else sm(l, p, tok)
    elif point == "checkpoint-optimizer":  # while DCP writes the optimizer of step 2
        import unison.checkpoint as C
        so = C.save_optimizer
        C.save_optimizer = lambda l, p: die() if t.step == 2 else so(l, p)
    elif point == "metrics":          # half a line into metrics.jsonl at step 3
        wm = t.runlog.write
        def torn(m):
            if m["step"] == 3:
                with (t.run_dir / "metrics.jsonl").open("a") as f:
                    f.write(__import__("json").dumps(m)[:40]); f.flush()
                die()
            wm(m)
        t.runlog.write = torn
    t.fit()
""")


@pytest.mark.parametrize("points", [
    pytest.param(("update", "checkpoint-optimizer"), id="two-points"),
    pytest.param(("rollout", "update", "checkpoint-weights", "checkpoint-optimizer", "metrics"), id="five-points",
                 marks=pytest.mark.faults)])
def test_sigkill_at_five_points_then_resume_completes_and_equals_the_uninterrupted_run(tmp_path, rewards, points):
    # the default suite kills at two of the points; `make test-faults` (CI) at all five
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(base=BASE))
    ref = subprocess.run([sys.executable, str(script), "none", str(tmp_path / "ref"), str(rewards)],
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    want = _comparable(read_metrics(tmp_path / "ref" / "metrics.jsonl"))
    assert len(want) == 5
    def kill_then_resume(point):  # each point in a directory of its own: two at a time (a process per core)
        out = tmp_path / point
        first = subprocess.run([sys.executable, str(script), point, str(out), str(rewards)],
                               capture_output=True, text=True, timeout=300)
        again = subprocess.run([sys.executable, str(script), "none", str(out), str(rewards)],
                               capture_output=True, text=True, timeout=300) if first.returncode == -9 else None
        return point, out, first, again

    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        for point, out, first, again in pool.map(kill_then_resume, points):
            assert first.returncode == -9, (point, first.stderr[-2000:])
            assert again.returncode == 0, (point, again.stderr[-2000:])
            assert _comparable(read_metrics(out / "metrics.jsonl")) == want, point
            assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())


def test_a_rank_stopped_by_sigterm_says_so_in_one_line_and_exits_143():
    # torchrun sends SIGTERM to the other ranks when one fails: wherever it lands (here in a sleep outside
    # any try), the rank prints one line and exits, never a traceback
    code = textwrap.dedent("""
        import os, signal, time
        from unison import cli
        signal.signal(signal.SIGTERM, cli._on_sigterm)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not reached")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, RANK="1", WORLD_SIZE="2"))
    assert r.returncode == 143 and r.stdout == ""
    assert r.stderr.splitlines() == ["unison: stopped (rank 1): torchrun ended this rank (SIGTERM: another rank "
                                     "failed — its error is above — or the job was cancelled); continue with "
                                     "--resume"]
