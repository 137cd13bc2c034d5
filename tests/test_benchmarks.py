"""The benchmarks still run: each at its smallest, on the tiny model, through its command line, and its JSON holds
the figures its docs quote (a benchmark that breaks when the code moves went unseen for two stops)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unison import gemm

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def test_rollout_throughput_reports_the_decode_and_the_update_against_the_bound():
    d = _run("rollout_throughput.py", "--model", "builtin:tiny", "--dtypes", "fp32", "--batch", "4",
             "--max-new-tokens", "8", "--update-steps", "1", "--repeats", "1", "--bandwidth-mib", "16",
             "--matmul-size", "256")
    r = d["results"][0]
    assert r["native_tokens_per_s"] > 0 and 0 < r["roofline"]["roofline_fraction"]
    sb = r["shape_bound"]  # the step's own products and attention, timed alone
    assert sb["products_ms_per_step"] > 0 and sb["attention_ms_per_step"] > 0 and sb["mean_keys"] >= 4
    assert sb["products_cache_hot_ms_per_step"] > 0
    assert sb["tokens_per_s"] == pytest.approx(4e3 / (sb["products_ms_per_step"] + sb["attention_ms_per_step"]),
                                               rel=0.02)
    assert sb["fraction"] == pytest.approx(r["native_tokens_per_s"] / sb["tokens_per_s"], rel=0.02)
    assert sb["native_ms_per_step"] == pytest.approx(4e3 / r["native_tokens_per_s"], rel=0.02)
    u = d["update_fp32"]
    assert u["update_gflop_per_s"] > 0 and 0 < u["fraction_of_matmul_peak"] and "fp32 matmuls" in u["gemm"]
    assert u["compile"].startswith("compile off")


def test_half_products_times_both_paths_at_every_shape():
    d = _run("half_products.py", "--rounds", "2")
    assert len(d["products"]) == 6 and set(d["native_kernels"]) == {"bf16", "fp16"}
    for row in d["products"]:
        assert {"fp32", "bf16 torch", "bf16 unison", "fp16 torch", "fp16 unison"} == set(row["us"])
        assert row["bf16 torch/unison"] > 0 and row["fp16 torch/unison"] > 0


@pytest.mark.skipif(not gemm.onednn_available(), reason="this torch has no oneDNN")
def test_gemm_auto_repeats_the_decision_and_times_both_libraries():
    d = _run("gemm_auto.py", "--repeats", "1", "--rounds", "2", "--threads", "1")
    for role in ("learner", "engine"):
        assert sum(d[role]["chosen"].values()) == 1 and len(d[role]["long_ratio_blas_over_onednn"]) == 3
    assert len(d["decision_s"]) == 1


def test_half_attention_compares_both_attentions_mismatch_and_speed():
    d = _run("half_attention.py", "--dtypes", "bf16", "--batch", "2", "--max-new-tokens", "4", "--seeds", "2",
             "--rounds", "2", "--threads", "1")
    row = d["dtypes"]["bf16"]
    arms = {f"{a}, {p}" for a in ("torch kernel", "fp32 attention") for p in ("fp32", "compute")}
    assert set(row["k3"]) == arms and all(len(a["seeds"]) == 2 for a in row["k3"].values())
    assert set(row["identical"]) == arms and all(0 <= f <= 1 for f in row["identical"].values())
    assert all(v > 0 for v in row["tokens_per_s"].values()) and row["fp32_over_torch"] > 0
    assert set(row["learner_forward_backward_s"]) == {"torch kernel", "fp32 attention"}
    assert all(v > 0 for v in row["learner_forward_backward_s"].values()) and row["learner_fp32_over_torch"] > 0
