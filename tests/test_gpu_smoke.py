"""scripts/gpu_smoke.sh and its checks (scripts/gpu_smoke.py), where a CPU can show them (issue 30): the time
budget and the total time-out, the exit status, the results folder, the install of only the missing wheels,
the check lines read past late warnings, checks that fail when they should, and the torch/transformers APIs
the smoke runs on. The dry run itself (SMOKE_DEVICE=cpu SMOKE_SMALL=1) is too slow for the suite: docs/gpu.md."""

import ast
import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"
_spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)


def _env(**kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOKE_")}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **kw}


# 2, 7, 8 — the budget, the total time-out, the exit status, the results -----------------------------------
def test_the_script_cut_by_its_total_time_out_still_prints_the_summary_and_exits_with_its_ok(tmp_path):
    results = tmp_path / "results"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "work")], capture_output=True, text=True, timeout=60,
                       env=_env(SMOKE_DEVICE="cpu", SMOKE_SMALL="1", SMOKE_TOTAL_S="2", RESULTS=str(results),
                                SMOKE_SITE=str(tmp_path / "site")))
    wall = time.monotonic() - t0
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    budget, summary = lines[0], lines[-1]
    assert budget["check"] == "budget" and budget["ok"]
    stages = dict(s.split(":") for s in budget["stage_timeouts_s"].split())
    assert sum(map(int, stages.values())) == budget["sum_s"] <= 530 and budget["stops_by_s"] <= 570
    assert {"install", "model", "probe", "train/gradient", "train/packed_vs_padded"} <= set(stages)
    cut = [c for c in lines if c.get("why") == "cut by the script's total time-out"]
    assert [c["check"] for c in cut] == ["install"]  # the stage that was running, named
    assert lines[-2]["check"] == "elapsed" and lines[-2]["ok"] is False
    assert summary["check"] == "summary" and summary["ok"] is False and "train/fp16" in summary["missing"]
    assert r.returncode == 1  # the summary's ok, not 0
    assert wall < 2 + 10 + 8  # cut at 2 s, 10 s for the stage to end, then the summary
    saved = (results / "checks.jsonl").read_text().splitlines()
    assert json.loads(saved[-1]) == summary and json.loads(saved[0]) == budget
    assert (results / "logs" / "install.log").is_file()
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "site")], capture_output=True).returncode == 1  # nothing left


def test_the_summary_ands_every_check_and_survives_a_line_that_is_not_json(tmp_path, capsys):
    checks = tmp_path / "checks.jsonl"
    ok = [json.dumps({"check": n, "ok": True}) for n in ("a", "b")]
    checks.write_text("\n".join(ok) + "\n")
    assert smoke.main(["summary", str(checks), "a", "b"]) == 0
    assert json.loads(capsys.readouterr().out) == {"check": "summary", "ok": True, "missing": [], "failed": [],
                                                   "unreadable_lines": []}
    checks.write_text("\n".join(ok) + "\nUserWarning: something late\n")
    assert smoke.main(["summary", str(checks), "a", "b", "c"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["missing"] == ["c"] and out["unreadable_lines"] == [3]
    checks.write_text(ok[0] + "\n" + json.dumps({"check": "b", "ok": "yes"}) + "\n")
    assert smoke.main(["summary", str(checks), "a", "b"]) == 1  # only a JSON true is ok


# 6 — a stage's check line is the last {"check" line of its log, warnings after it or not -----------------
def test_a_check_line_is_found_past_late_warnings_and_a_failed_stage_says_why(tmp_path):
    log = tmp_path / "model.log"
    line = {"check": "model", "ok": True, "mean_entropy_nats": 1.8}
    log.write_text("Writing model shards: 100%\n" + json.dumps(line) + "\n/x.py:3: FutureWarning: late\n  warn()\n")
    assert smoke.last_check(log) == line
    assert smoke.emit("model", log, 0) == line
    assert smoke.emit("model", log, 124) == {"check": "model", "ok": False, "why": "timed out", "log": str(log),
                                             "reported": line}
    assert smoke.emit("probe", log, 0)["why"] == "no check line in its log"  # another stage's line is not ours
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    assert smoke.emit("model", log, 1) == {"check": "model", "ok": False, "why": "exit status 1", "log": str(log)}


# 3 — only the wheels the image lacks, into a folder of their own; unison from the tree --------------------
def _wheel(path: Path, dist: str, module: str) -> Path:
    files = {f"{module}/__init__.py": b"ANSWER = 42\n",
             f"{dist}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n".encode(),
             f"{dist}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}

    def digest(b: bytes) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()

    record = "".join(f"{n},sha256={digest(b)},{len(b)}\n" for n, b in files.items()) + f"{dist}-0.1.dist-info/RECORD,,\n"
    whl = path / f"{dist}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr(f"{dist}-0.1.dist-info/RECORD", record)
    return whl


def test_install_puts_only_the_missing_wheels_on_the_pythonpath_and_imports_unison_from_the_tree(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "unison_smoke_probe", "unison_smoke_probe")
    (wheels / "PyYAML-6.0.4-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"not a wheel: never opened")
    path = os.pathsep.join([str(ROOT), str(site), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "install", str(wheels), str(site), "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(PYTHONPATH=path), timeout=300)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["installed"] == ["unison_smoke_probe"] and "PyYAML" in out["image_has"]  # the image's stays
    assert (site / "unison_smoke_probe" / "__init__.py").is_file() and not (site / "yaml").exists()
    assert out["unison_from_tree"] and not out["missing_apis"] and out["ok"], out
    sys.path.insert(0, str(site))
    try:  # a rerun installs nothing: the folder is on the path
        assert smoke.missing_wheels(sorted(wheels.glob("*.whl")))[0] == []
    finally:
        sys.path.remove(str(site))


def test_without_pip_the_missing_wheels_are_unpacked_into_the_folder(tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "unison_smoke_probe", "unison_smoke_probe")
    monkeypatch.setattr(smoke, "_has_pip", lambda: False)
    assert smoke.install(wheels, site)["installed"] == ["unison_smoke_probe"]
    assert (site / "unison_smoke_probe" / "__init__.py").read_text() == "ANSWER = 42\n"
    assert (site / "unison_smoke_probe-0.1.dist-info" / "METADATA").is_file()  # the next run sees it installed


def test_the_script_extends_pythonpath_and_never_installs_into_the_image():
    text = SCRIPT.read_text()
    assert 'export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"' in text
    assert "env PYTHONPATH=" not in text and "pip install" not in text and "-e ." not in text
    assert "keep: 1" in text and "every: 0, every_minutes: 0" in text  # only the final checkpoint (1)
    assert "grad_noise: false" in text  # (13)


# 4, 5 — the checks fail when the numbers say nothing ---------------------------------------------------------
def _rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _step(**kw):
    return {"optim/steps": 2, "optim/skipped_steps": 0, "optim/loss_scale": 65536.0, "optim/grad_norm": 0.5,
            "reward/std": 0.1, "mismatch/num_tokens": 100, "time/generate_s": 1.0, "time/update_s": 2.0,
            "time/step_s": 3.0, **kw}


def test_a_training_run_fails_its_check_without_reward_variance_or_with_the_wrong_loss_scale(tmp_path):
    run = tmp_path / "r"
    _rows(run / "metrics.jsonl", [_step(), _step(**{"optim/skipped_steps": 1, "optim/loss_scale": 32768.0})])
    assert smoke.train_check(run, "fp16", 2, "fp16")["ok"]  # one skipped step: the scale halved once
    _rows(run / "metrics.jsonl", [_step(), _step(**{"optim/skipped_steps": 1})])
    assert not smoke.train_check(run, "fp16", 2, "fp16")["ok"]  # skipped, yet the scale did not move
    _rows(run / "metrics.jsonl", [_step(), _step(**{"reward/std": 0.0})])
    assert not smoke.train_check(run, "fp16", 2, "fp16")["ok"]  # equal rewards: a zero gradient
    _rows(run / "metrics.jsonl", [_step(**{"optim/loss_scale": 1.0})])
    assert not smoke.train_check(run, "bf16", 2, "bf16")["ok"]  # a step missing
    assert smoke.train_check(run, "bf16", 1, "bf16")["ok"]


def test_the_gradient_check_needs_every_tensor_moved_and_one_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    start = {"a": torch.zeros(3), "b": torch.ones(2, 2)}
    (tmp_path / "m").mkdir()
    save_file(start, str(tmp_path / "m" / "model.safetensors"))
    run = tmp_path / "r"
    _rows(run / "metrics.jsonl", [_step()])

    def checkpoint(step, weights):
        d = run / "checkpoints" / f"step_{step:06d}" / "model"
        d.mkdir(parents=True)
        save_file(weights, str(d / "model.safetensors"))

    checkpoint(1, {"a": torch.full((3,), 1e-6), "b": start["b"].clone()})
    out = smoke.gradient_check(run, tmp_path / "m")
    assert not out["ok"] and out["unmoved"] == ["b"] and out["tensors_moved"] == "1/2"
    checkpoint(2, {"a": torch.full((3,), 1e-6), "b": start["b"] + 1e-6})
    out = smoke.gradient_check(run, tmp_path / "m")
    assert out["tensors_moved"] == "2/2" and not out["ok"]  # two checkpoints kept: keep: 1 is not in force
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_000001")
    assert smoke.gradient_check(run, tmp_path / "m")["ok"]
    _rows(run / "metrics.jsonl", [_step(**{"optim/grad_norm": 0.0})])
    assert not smoke.gradient_check(run, tmp_path / "m")["ok"]


def test_packed_and_padded_steps_must_share_rollouts_of_varied_lengths_and_agree(tmp_path):
    def run(name, k3=0.01, ent=1.5, loss=0.001, lengths=(3, 9, 16)):
        d = tmp_path / name
        _rows(d / "metrics.jsonl", [{"mismatch/k3": k3, "policy/entropy": ent, "policy/loss": loss}])
        _rows(d / "rollouts" / "step_000001.jsonl", [{"token_ids": list(range(n))} for n in lengths])
        return d

    padded = run("padded", loss=-0.06)
    assert smoke.packed_check(run("a", k3=0.015, ent=1.51, loss=-0.0602), padded)["ok"]
    assert not smoke.packed_check(run("b", k3=0.5, loss=-0.06), padded)["ok"]  # attention across responses
    assert not smoke.packed_check(run("c", ent=1.2, loss=-0.06), padded)["ok"]
    assert not smoke.packed_check(run("g", loss=-0.05), padded)["ok"]
    assert not smoke.packed_check(run("d", loss=-0.06, lengths=(3, 9, 15)), padded)["ok"]  # other rollouts
    same = run("e", lengths=(16, 16, 16))
    assert not smoke.packed_check(run("f", lengths=(16, 16, 16)), same)["ok"]  # nothing to pack


# 14 — the torch/transformers APIs the smoke runs on; nothing pinned that the GPU image cannot satisfy -------
def test_every_torch_and_transformers_import_of_the_package_is_in_the_smokes_api_list():
    listed = set(smoke.APIS)
    missing = []
    for f in sorted((ROOT / "unison").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] in ("torch", "transformers"):
                for a in node.names:
                    ok = any(s.endswith(f":{a.name}") or f":{a.name}." in s for s in listed) \
                        if node.module == "transformers" else \
                        any(s == f"{node.module}:{a.name}" or s.startswith(f"{node.module}:{a.name}.") for s in listed)
                    if not ok:
                        missing.append(f"{f.relative_to(ROOT)}: from {node.module} import {a.name}")
    assert not missing, missing
    assert smoke.missing_apis() == []  # and they exist here


def test_the_api_reader_finds_what_the_sources_define_and_what_they_do_not(tmp_path):
    pkg = tmp_path / "torch" / "distributed"
    pkg.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .core import *\nfrom ._shard import shard as fully_shard\n")
    (pkg / "core.py").write_text("def init(backend, timeout=None):\n    pass\n\nclass Opts:\n    strict: bool = True\n")
    (pkg / "_shard.py").write_text("class T:\n    def __init__(self):\n        self.head = 1\n\n"
                                   "def shard(module, *, mesh=None):\n    pass\n")
    src = smoke.Sources(tmp_path)
    assert src.check("torch.distributed:init", ("backend", "timeout")) is None  # through import *
    assert src.check("torch.distributed:init", ("device_id",)) == "no keyword device_id"
    assert src.check("torch.distributed:fully_shard", ("mesh",)) is None  # a re-export under another name
    assert src.check("torch.distributed:Opts", ("strict",)) is None
    assert src.check("torch.distributed:Opts", ("cpu_offload",)) == "no keyword cpu_offload"
    assert src.check("torch.distributed._shard:T.head", ()) is None  # set in __init__
    assert src.check("torch.distributed._shard:T.tail", ()) == "no attribute tail"
    assert src.check("torch.distributed:destroy", ()) == "not defined"


def test_the_package_requires_nothing_the_gpu_image_cannot_satisfy():
    import tomllib

    from packaging.requirements import Requirement

    deps = {Requirement(d).name: Requirement(d) for d in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    image = {"torch": "2.11.0", "transformers": "5.17.0"}  # ../shared/ENVIRONMENT.md, "The GPU machine"
    for name, version in image.items():
        assert deps[name].specifier.contains(version), f"pyproject.toml requires {deps[name]}; the image has {version}"


# 4 — the smoke model's tokenizer decodes every one of its 151,936 ids ------------------------------------
def test_a_character_tokenizer_of_a_real_vocab_size_decodes_every_id_and_encodes_text_as_before():
    from unison.errors import UnisonError
    from unison.models import build_char_tokenizer

    small, big = build_char_tokenizer(), build_char_tokenizer(vocab_size=smoke.VOCAB)
    assert len(small) == 100 and len(big) == smoke.VOCAB
    text = "12+35=47. The quick brown fox"
    assert big(text)["input_ids"] == small(text)["input_ids"]  # one id per character, as before
    texts = big.batch_decode([[i] for i in range(smoke.VOCAB)])
    special = set(big.all_special_ids)
    assert all(t for i, t in enumerate(texts) if i not in special) and len(set(texts)) == smoke.VOCAB  # each its own
    assert small.decode([5000]) == "" and big.decode([5000]) == texts[5000] != ""  # the old one dropped it
    try:
        build_char_tokenizer(vocab_size=50)
    except UnisonError as e:
        assert "100 to" in str(e)
    else:
        raise AssertionError("a vocabulary smaller than the characters was accepted")
