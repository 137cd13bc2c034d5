"""`unison probe` end to end, and its answers to bad input."""

import json
import subprocess
import sys

import pytest

from unison.cli import main

SMALL = ["--n", "2", "--max-new-tokens", "48"]


def run_cli(args, cwd=None):
    return subprocess.run([sys.executable, "-m", "unison", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_probe_writes_contract_and_is_deterministic(tmp_path, tiny_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["probe", *SMALL, "--out", str(a)]) == 0
    assert main(["probe", *SMALL, "--out", str(b)]) == 0
    text = (a / "probe.json").read_text()
    assert text == (b / "probe.json").read_text()
    results = json.loads(text)["results"]
    assert [(r["engine"], r["precision"]) for r in results] == [
        ("native", "fp32"), ("native", "bf16"), ("native", "fp16")]
    for r in results:
        for key in ("k1", "k2", "k3", "seq_kl", "prob_diff_mean", "prob_diff_max", "log_ppl_diff",
                    "log_ppl_abs_diff", "ppl_ratio", "chi2_token", "chi2_seq"):
            assert isinstance(r[f"mismatch/{key}"], float)
        assert r["mismatch/num_tokens"] > 0
        assert "seq_log_ratio_slope_per_1k" in r
    k3 = {r["precision"]: r["mismatch/k3"] for r in results}
    assert k3["bf16"] > k3["fp16"] > k3["fp32"]
    assert (a / "plots" / "token_probs_scatter.png").stat().st_size > 10_000
    assert (a / "plots" / "seq_log_ratio_vs_length.png").stat().st_size > 10_000


def _bad_prompts(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("case", ["missing_model", "no_config", "precision", "engine", "empty",
                                  "bad_json", "missing_field", "wrong_type", "missing_prompts"])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, case):
    out = tmp_path / "out"
    args = ["probe", "--out", str(out), *SMALL]
    expect = {
        "missing_model": (["--model", str(tmp_path / "nope")], "does not exist"),
        "no_config": (["--model", str(tmp_path)], "no config.json"),
        "precision": (["--precision", "fp32,fp8"], "set rollout.quantization=fp8"),
        "engine": (["--engine", "sglang"], "unknown engine 'sglang'"),
        "empty": (["--prompts", _bad_prompts(tmp_path, "e.jsonl", "\n\n")], "has no rows"),
        "bad_json": (["--prompts", _bad_prompts(tmp_path, "b.jsonl", '{"prompt": "a"}\n{oops\n')],
                     "b.jsonl:2: not valid JSON"),
        "missing_field": (["--prompts", _bad_prompts(tmp_path, "m.jsonl", '{"text": "a"}\n')],
                          "m.jsonl:1: missing field 'prompt'"),
        "wrong_type": (["--prompts", _bad_prompts(tmp_path, "w.jsonl", '{"prompt": 3}\n')],
                       "field 'prompt' must be str"),
        "missing_prompts": (["--prompts", str(tmp_path / "none.jsonl")], "does not exist"),
    }[case]
    proc = run_cli(args + expect[0])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unison: error:"), proc.stderr
    assert expect[1] in lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_help_lists_probe():
    proc = run_cli(["probe", "--help"])
    assert proc.returncode == 0 and "--max-new-tokens" in proc.stdout


def test_the_probes_tables_are_whole_through_a_pipe(tmp_path):
    """stdout a pipe (``unison probe > log``, CI logs): rich assumes 80 columns there and cut every header to
    "fin…"; the tables are sized to their content (issue 57, item 3; issue 51, item 10)."""
    r = run_cli(["probe", "--precision", "fp32", "--n", "2", "--max-new-tokens", "12", "--ledger",
                 "--quantization", "none,int4", "--top-p", "1,0.9", "--out", str(tmp_path / "p")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "…" not in r.stdout, r.stdout[:3000]
    for header in ("engine", "precision", "seq KL (k3)", "slope/1K", "peak RSS GiB", "decode", "total k3",
                   "Σ k1 = total k1"):
        assert header in r.stdout
    widths = {len(line) for line in r.stdout.splitlines() if line.startswith(("┃", "│"))}
    assert widths and max(widths) > 80  # wider than rich's default for a pipe: nothing was squeezed to fit
