import pytest

from unison.config import Config, dump_config, load_config
from unison.errors import UnisonError


def test_defaults_and_contract_keys_take_set_overrides():
    cfg = load_config(None, ["seed=3", "precision=fp16", "engine=native", "algo=grpo_token_tis",
                             "train.steps=7", "train.lr=1e-5", "checkpoint.every=2"])
    assert (cfg.seed, cfg.precision, cfg.engine, cfg.algo) == (3, "fp16", "native", "grpo_token_tis")
    assert (cfg.train.steps, cfg.train.lr, cfg.checkpoint.every) == (7, 1e-5, 2)


def test_yaml_file_and_round_trip(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("precision: bf16\ntrain:\n  lr: 1e-5\n  betas: [0.9, 0.99]\n")
    cfg = load_config(p)
    assert cfg.precision == "bf16" and cfg.train.lr == 1e-5 and cfg.train.betas == (0.9, 0.99)
    (tmp_path / "d.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "d.yaml") == cfg


@pytest.mark.parametrize("override,message", [
    ("train.lrr=1", "unknown config key 'train.lrr': did you mean 'train.lr'?"),
    ("precison=fp16", "did you mean 'precision'?"),
    ("train.steps=abc", "config key 'train.steps'"),
    ("train.steps=0", "greater than or equal to 1"),
    ("rollout.top_p=1.5", "config key 'rollout.top_p'"),
    ("precision=fp8", "set rollout.quantization=fp8"),
    ("engine=sglang", "unknown engine 'sglang'"),
    ("train=3", "must be a section"),
    ("noequals", "is not key=value"),
])
def test_bad_config_is_one_line(override, message):
    with pytest.raises(UnisonError) as e:
        load_config(None, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UnisonError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(UnisonError, match="not valid YAML"):
        load_config(bad)


def test_shipped_configs_load():
    from pathlib import Path

    for p in sorted((Path(__file__).parents[1] / "configs").rglob("*.yaml")):
        assert isinstance(load_config(p), Config), p


def test_config_file_that_is_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"seed: 1\n# caf\xe9\n")
    with pytest.raises(UnisonError) as e:
        load_config(p)
    assert str(e.value) == f"config file '{p}' is not UTF-8 text (line 2): re-save it as UTF-8"
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfseed: 3\n")  # a byte-order mark is fine
    assert load_config(bom).seed == 3


def test_every_config_key_is_in_the_reference():
    """docs/config.md names every key of unison/config.py (the reference cannot drift)."""
    from pathlib import Path

    from pydantic import BaseModel

    from unison.config import Config

    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text(encoding="utf-8")

    def leaves(model, prefix=""):
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from leaves(ann, prefix + name + ".")
            else:
                yield prefix + name

    missing = [k for k in leaves(Config) if f"`{k.rsplit('.', 1)[-1]}`" not in doc and f"`{k}`" not in doc]
    assert not missing, missing
