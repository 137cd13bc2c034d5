"""bf16 / fp16 products on a CPU without native kernels for them: torch's own path against unison's (fp32 products
of the rounded operands, rounded once: unison.gemm.torch_linear), side by side (issue 56, item 4).

Two parts, one JSON line:

1. **Products**, forward and backward, at the demo's tiny model's shapes and SmolLM2-135M's, at 8 and 512 rows:
   fp32, then each half dtype by torch's path and by unison's, in alternated rounds (best of each).
2. **The demo's part-1 arm** (``--arm``: the 30-step sanity run in bf16 and fp16, from the shipped warm start, one
   thread), by torch's path and by unison's, each in a fresh process, the two dtypes side by side as the demo runs
   them; fp32 once beside them. Every arm's reward and token k3 too: the route must not change what the arm finds.

On a CPU with native kernels (AVX512-BF16 / AMX for bf16, AVX512-FP16 for fp16), unison keeps torch's path: there,
``--no-onednn`` switches oneDNN off (``torch.backends.mkldnn.enabled = False``) with torch's AVX2 kernels
(``ATEN_CPU_CAPABILITY=avx2``, MKL's ``MKL_ENABLE_INSTRUCTIONS=AVX2``) — a proxy of an AVX2-only CPU for these
products, not one: the memory, the clock and the fp32 BLAS are still this CPU's.

    python benchmarks/half_products.py                      # products, this CPU as it is
    python benchmarks/half_products.py --no-onednn --arm    # the proxy, with the demo's arm (~3 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

#: (name, in, out) of the products: the tiny model's q/k/v-o and MLP, SmolLM2's MLP
SHAPES = [("tiny MLP", 128, 384), ("tiny attention", 128, 128), ("SmolLM2 MLP", 576, 1536)]

ARM = """
import json, sys, time, torch
{setup}
from unison import gemm
if not {route}:
    gemm.half_route = lambda dtype: False
from pathlib import Path
from unison.demo import PRECISION_STEPS, seed_warm_start
from unison.sanity import run_sanity, sanity_config, warm_start
out = Path({out!r})
cfg = sanity_config(None, PRECISION_STEPS + ["threads=1"])
seed_warm_start(cfg, out, "precision", 8, 32, lambda m: None)
warm_start(cfg, out, k=8, max_prompts=32, log=lambda m: None)
t0 = time.perf_counter()
run_sanity(cfg, out, [{precision!r}], ["grpo"], k=8, max_prompts=32, quantizations=["none"], report=False,
           log=lambda m: None)
wall = time.perf_counter() - t0
s = json.loads(next(out.glob("arms/*/summary.json")).read_text())
print(json.dumps({{"wall_s": wall, "reward_last5": s["reward_last5_mean"], "k3": s["final"].get("mismatch/k3")}}))
"""


def _setup(no_onednn: bool) -> str:
    return "torch.backends.mkldnn.enabled = False" if no_onednn else ""


def products(rounds: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from unison import gemm

    def step(fn, x, w):
        x.grad = w.grad = None
        fn(x, w).float().sum().backward()

    out = []
    for name, k, n in SHAPES:
        for rows in (8, 512):
            torch.manual_seed(0)
            x32, w32 = torch.randn(rows, k, requires_grad=True), torch.randn(n, k, requires_grad=True)
            row = {"shape": name, "rows": rows, "in": k, "out": n}
            def route(a, b):
                return gemm._HalfLinear.apply(a, b, None, a.dtype)

            cases = [("fp32", lambda: step(F.linear, x32, w32))]
            for dt, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
                xh, wh = (t.detach().to(dt).requires_grad_() for t in (x32, w32))
                cases += [(f"{label} torch", lambda xh=xh, wh=wh: step(F.linear, xh, wh)),
                          (f"{label} unison", lambda xh=xh, wh=wh: step(route, xh, wh))]
            best = {}
            for case, f in cases:  # warm-up
                f()
                best[case] = float("inf")
            for r in range(rounds):
                for case, f in cases if r % 2 == 0 else cases[::-1]:
                    t0 = time.perf_counter()
                    f()
                    best[case] = min(best[case], time.perf_counter() - t0)
            row["us"] = {c: round(t * 1e6, 1) for c, t in best.items()}
            for label in ("bf16", "fp16"):
                row[f"{label} torch/unison"] = round(best[f"{label} torch"] / best[f"{label} unison"], 2)
            out.append(row)
            print(f"[half_products] {name} × {rows} rows: bf16 {row['bf16 torch/unison']}x, fp16 "
                  f"{row['fp16 torch/unison']}x faster by unison's path", file=sys.stderr, flush=True)
    return out


def arm(precision: str, route: bool, no_onednn: bool, env: dict) -> subprocess.Popen:
    out = tempfile.mkdtemp(prefix=f"half-arm-{precision}-")
    code = ARM.format(setup=_setup(no_onednn), route=route, out=out, precision=precision)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate()
    if p.returncode != 0:
        sys.exit(f"half_products: an arm failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-onednn", action="store_true", help="the proxy of a CPU without native half kernels")
    ap.add_argument("--arm", action="store_true", help="also the demo's part-1 arm by each path")
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    env = dict(os.environ)
    if a.no_onednn and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":  # torch reads it at import: start again
        env.update(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2")
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    import torch

    torch.set_num_threads(1)
    if a.no_onednn:
        torch.backends.mkldnn.enabled = False
    from unison import gemm

    res = {"benchmark": "half_products", "cpu": cpu_model(), "torch": torch.__version__, "threads": 1,
           "proxy_no_onednn_avx2": a.no_onednn,
           "native_kernels": {"bf16": gemm.half_kernels(torch.bfloat16), "fp16": gemm.half_kernels(torch.float16)},
           "products": products(a.rounds)}
    if a.arm:
        arms = {}
        for route in (False, True):  # the two half arms side by side, as the demo's two workers run them
            label = "unison" if route else "torch"
            ps = {p: arm(p, route, a.no_onednn, env) for p in ("bf16", "fp16")}
            arms.update({f"{p} {label}": _result(proc) for p, proc in ps.items()})
            print(f"[half_products] arms by {label}'s path: " + ", ".join(
                f"{p} {arms[f'{p} {label}']['wall_s']:.1f} s" for p in ps), file=sys.stderr, flush=True)
        arms["fp32"] = _result(arm("fp32", True, a.no_onednn, env))
        res["arm"] = arms
        res["arm_torch_over_unison"] = {p: round(arms[f"{p} torch"]["wall_s"] / arms[f"{p} unison"]["wall_s"], 2)
                                        for p in ("bf16", "fp16")}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
