"""The warm starts `unison demo` ships (unison/data/demo, made by scripts/make_demo_warm_starts.py): each is what
its manifest says — the files' sha256, a model that loads and scores its SFT eval within 0.02 of the manifest's
numbers — and the demo takes it only for the configuration it was made with."""

import json
from pathlib import Path

import pytest
import torch

from unison.demo import COLLAPSE_RECIPE, PRECISION_STEPS, WARM_STARTS, fingerprint, seed_warm_start
from unison.errors import UnisonError
from unison.sanity import sanity_config

PARTS = {"precision": (PRECISION_STEPS, 32), "collapse": (COLLAPSE_RECIPE, 64)}


@pytest.mark.parametrize("part", list(PARTS))
def test_a_shipped_warm_start_loads_and_scores_its_sft_eval(part):
    from unison.rollout import make_engine
    from unison.sft import sft_eval

    d = WARM_STARTS / part
    manifest = json.loads((d / "manifest.json").read_text())
    steps, prompts = PARTS[part]
    cfg = sanity_config(None, steps)
    assert manifest["fingerprint"] == fingerprint(cfg, 8, prompts)  # made with the demo's recipe
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    assert size < 4e6, f"{part}'s warm start is {size / 1e6:.1f} MB"
    engine = make_engine("native", d / "model", torch.float32)
    got = sft_eval(cfg, engine, train=False)
    for key in ("eval_accuracy_sampled", "eval_accuracy_greedy"):
        assert abs(got[key] - manifest["sft"][key]) <= 0.02, (key, got[key], manifest["sft"][key])
    assert sum(1 for _ in open(d / "perfectible.jsonl")) > 0


def test_the_demo_takes_a_shipped_warm_start_only_for_its_recipe(tmp_path):
    logs = []
    cfg = sanity_config(None, PRECISION_STEPS)
    assert seed_warm_start(cfg, tmp_path / "p", "precision", 8, 32, logs.append)
    assert (tmp_path / "p" / "sft" / "model" / "model.safetensors").read_bytes() == \
        (WARM_STARTS / "precision" / "model" / "model.safetensors").read_bytes()
    assert (tmp_path / "p" / "perfectible.jsonl").read_text() == (WARM_STARTS / "precision" / "perfectible.jsonl").read_text()
    other = sanity_config(None, PRECISION_STEPS + ["sft.steps=10"])  # another recipe: the demo makes its own
    assert not seed_warm_start(other, tmp_path / "q", "precision", 8, 32, logs.append)
    assert not (tmp_path / "q").exists() and "making one" in logs[-1]
    assert not seed_warm_start(cfg, tmp_path / "r", "precision", 8, 16, logs.append)  # another filter size


def test_a_tampered_warm_start_is_refused_in_one_line(tmp_path, monkeypatch):
    import shutil

    import unison.demo as demo

    fake = tmp_path / "ws"
    shutil.copytree(WARM_STARTS / "precision", fake / "precision")
    (fake / "precision" / "perfectible.jsonl").write_text('{"prompt": "1+1"}\n')
    monkeypatch.setattr(demo, "WARM_STARTS", fake)
    with pytest.raises(UnisonError, match="does not match its manifest .* --from-scratch"):
        seed_warm_start(sanity_config(None, PRECISION_STEPS), tmp_path / "p", "precision", 8, 32, lambda m: None)
    assert not (tmp_path / "p" / "sft").exists()  # nothing half-copied


@pytest.mark.slow
@pytest.mark.parametrize("part", list(PARTS))
def test_from_scratch_reproduces_the_shipped_warm_start_on_the_cpu_that_made_it(part, tmp_path):
    """`unison demo --from-scratch` makes what is shipped: its SFT eval within 0.02 (the precision part ≈ 1.5 min,
    the collapse part ≈ 8 min on 2 cores). Elsewhere the kernels differ, and so may the warm start."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_demo_warm_starts import cpu

    from unison.sanity import warm_start

    manifest = json.loads((WARM_STARTS / part / "manifest.json").read_text())
    if cpu() != manifest["cpu"] or torch.__version__ != manifest["torch"]:
        pytest.skip(f"made on {manifest['cpu']} with torch {manifest['torch']}; this is {cpu()}, torch "
                    f"{torch.__version__}")
    steps, prompts = PARTS[part]
    warm_start(sanity_config(None, steps), tmp_path, k=8, max_prompts=prompts, log=lambda m: None)
    made = json.loads((tmp_path / "sft" / "sft.json").read_text())
    for key in ("eval_accuracy_sampled", "eval_accuracy_greedy"):
        assert abs(made[key] - manifest["sft"][key]) <= 0.02, (key, made[key], manifest["sft"][key])


def test_from_scratch_replaces_a_shipped_copy_and_keeps_a_made_one(tmp_path):
    from unison.demo import SHIPPED, drop_shipped

    cfg = sanity_config(None, PRECISION_STEPS)
    assert seed_warm_start(cfg, tmp_path / "p", "precision", 8, 32, lambda m: None)
    assert (tmp_path / "p" / "sft" / SHIPPED).exists()
    drop_shipped(tmp_path / "p", lambda m: None)  # an earlier run's shipped copy: --from-scratch makes its own
    assert not (tmp_path / "p" / "sft").exists() and not (tmp_path / "p" / "perfectible.jsonl").exists()
    made = tmp_path / "m" / "sft" / "model"
    made.mkdir(parents=True)
    (made / "config.json").write_text("{}")
    drop_shipped(tmp_path / "m", lambda m: None)  # made here: kept
    assert (made / "config.json").exists()


def test_a_seed_named_twice_is_refused_in_one_line(tmp_path, capsys):
    from unison.cli import main

    assert main(["demo", "--out", str(tmp_path / "d"), "--seeds", "0,0"]) == 2
    assert "names a seed twice" in capsys.readouterr().err and not (tmp_path / "d").exists()
