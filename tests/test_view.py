"""unison view's records and page without a browser (tests/test_browser.py renders them in chromium): the records'
figures on a batch computed by hand, the choice of responses by k3, thinning of old steps, the page's data, the
refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unison.batch import Completion, collate
from unison.cli import main
from unison.view import render, summary, token_records, write_step


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def _batch():
    # row 0: prompt [1], response [2, 3] with log μ [-1.0, -2.0]; row 1: prompt [4, 5], response [6] with log μ [-0.5]
    comps = [Completion([1], [2, 3], [-1.0, -2.0], "stop", version=3),
             Completion([4, 5], [6], [-0.5], "stop", prompt_index=1, version=2)]
    return collate(comps, pad_id=0)


def _pi(b):
    """log π_old: row 0 [-1.1, -2.0] (Δ = -0.1, 0), row 1 [-0.2] (Δ = +0.3)."""
    pi = torch.zeros(b.tokens.shape)
    pi[0, 1:3] = torch.tensor([-1.1, -2.0])
    pi[1, 2:3] = torch.tensor([-0.2])
    return pi


def _k3(d):  # per token e^Δ − 1 − Δ with Δ = log π − log μ
    return math.expm1(d) - d


def test_records_carry_each_tokens_figures_by_hand():
    b = _batch()
    w = torch.zeros(b.tokens.shape)
    w[0, 1:3] = torch.tensor([1.0, 0.0])  # the second token of row 0 masked
    w[1, 2] = 0.5
    recs, of = token_records(b, torch.tensor([0, 1]), _pi(b), w, _Tok(), limit=5, rewards=torch.tensor([1.0, 0.0]))
    assert of == 2 and [r["row"] for r in recs] == [0, 1]
    r0, r1 = recs
    assert r0["prompt"] == "b" and r1["prompt"] == "ef"  # the prompt's tokens, decoded
    assert r0["tokens"] == [[2, "c", -1.0, -1.1, 3, 1.0], [3, "d", -2.0, -2.0, 3, 0.0]]
    assert r1["tokens"] == [[6, "g", -0.5, -0.2, 2, 0.5]]
    assert r0["k3"] == pytest.approx((_k3(-0.1) + _k3(0.0)) / 2, abs=1e-6)
    assert r1["k3"] == pytest.approx(_k3(0.3), abs=1e-6)
    assert (r0["reward"], r1["reward"], r0["group"], r1["group"]) == (1.0, 0.0, 0, 1)


def test_records_keep_the_responses_of_largest_k3_and_only_known_rows():
    b = _batch()
    recs, of = token_records(b, torch.tensor([0, 1]), _pi(b), None, _Tok(), limit=1)
    assert of == 2 and [r["row"] for r in recs] == [1]  # k3(0.3) = 0.0499 > row 0's 0.0026
    assert recs[0]["tokens"][0][5] is None  # no correction: no weight
    recs, of = token_records(b, torch.tensor([0]), _pi(b), None, _Tok(), limit=5)  # row 1's π_old unknown
    assert of == 1 and [r["row"] for r in recs] == [0]


def test_records_split_each_token_by_the_ledgers_terms():
    b = _batch()
    eng = torch.zeros(b.tokens.shape)
    eng[0, 1:3] = torch.tensor([-0.04, 0.0])
    terms = {"engine": eng, "staleness": (b.logp_mu - _pi(b)) * b.response_mask - eng}
    (r0, _), _ = token_records(b, torch.tensor([0, 1]), _pi(b), None, _Tok(), limit=5, terms=terms)
    assert r0["ledger"]["engine"] == [-0.04, 0.0]
    assert r0["ledger"]["staleness"] == pytest.approx([0.14, 0.0])  # the terms add up to log μ − log π_old
    assert [sum(x) for x in zip(*r0["ledger"].values())] == pytest.approx([0.1, 0.0])


def test_summary_takes_k3_and_the_ledgers_terms_not_their_total():
    m = {"mismatch/k3": 0.01, "mismatch/k1": 0.02, "reward/mean": 0.5, "loss": 3.0,
         "ledger/engine_k3": 0.004, "ledger/staleness_k3": 0.006, "ledger/total_k3": 0.01, "ledger/engine_k1": 0.1}
    assert summary(m) == {"mismatch/k3": 0.01, "mismatch/k1": 0.02, "reward/mean": 0.5,
                          "ledger": {"engine": 0.004, "staleness": 0.006}}


def test_old_steps_are_thinned_and_recent_ones_kept(tmp_path):
    for step in range(1, 31):
        write_step(tmp_path, step, [], 0, {"mismatch/k3": step / 100}, recent=5, thin=10)
    kept = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "tokens").glob("step_*.json"))
    assert kept == [10, 20, 26, 27, 28, 29, 30]


def test_the_page_holds_every_step_and_points_at_the_worst(tmp_path):
    b = _batch()
    recs, of = token_records(b, torch.tensor([0, 1]), _pi(b), None, _Tok(), limit=5)
    for step, k in ((1, 0.01), (2, 0.05), (3, 0.02)):
        write_step(tmp_path, step, recs, of, {"mismatch/k3": k})
    assert main(["view", str(tmp_path)]) == 0
    html = (tmp_path / "view.html").read_text()
    blob = html.split("const DATA = ", 1)[1].split(";\n", 1)[0]
    data = json.loads(blob.replace("<\\/", "</"))
    assert [v["key"] for v in data["views"]] == ["step 1", "step 2", "step 3"]
    assert data["default"] == 2 and data["worst"] == 1
    assert data["views"][0]["responses"] == recs


def test_a_prompt_cannot_close_the_pages_script(tmp_path):
    write_step(tmp_path, 1, [{"row": 0, "group": 0, "k3": 0.0, "prompt": "</script><b>x", "tokens": []}], 1, {})
    html = render(tmp_path).read_text()
    assert "</script><b>x" not in html and html.count("</script>") == 1


def test_a_directory_without_records_is_refused_in_one_line(tmp_path, capsys):
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no token records" in err[0] and "log.tokens" in err[0]
    assert not (tmp_path / "view.html").exists()
    assert main(["view", str(tmp_path / "absent")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_run_records_its_tokens_and_writes_its_page(tmp_path):
    """A 2-step run: every response recorded (log.tokens ≥ the batch); over a step's tokens mean(log μ − log π_old)
    is the step's k1; the page and the report's link to it are written at the end."""
    from unison.config import load_config
    from unison.data_io import read_metrics
    from unison.trainer import Trainer

    cfg = load_config(None, ["task.digits=1", "task.train_size=20", "task.eval_size=0", "rollout.n=2",
                             "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.steps=2",
                             "log.console=false", "log.tensorboard=false", "rollout_precision=bf16",
                             "log.tokens=16"])
    Trainer(cfg, tmp_path / "run", log=lambda m: None).fit()
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    for step in (1, 2):
        d = json.loads((run / "tokens" / f"step_{step:06d}.json").read_text())
        assert d["of"] == 4 and len(d["responses"]) == 4
        toks = [t for r in d["responses"] for t in r["tokens"]]
        assert len(toks) == rows[step - 1]["mismatch/num_tokens"]
        k1 = sum(t[2] - t[3] for t in toks) / len(toks)
        assert k1 == pytest.approx(rows[step - 1]["mismatch/k1"], abs=2e-4)
        assert d["summary"]["mismatch/k3"] == rows[step - 1]["mismatch/k3"]
    assert (run / "view.html").is_file() and "(view.html)" in (run / "report.md").read_text()
