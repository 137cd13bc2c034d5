#!/usr/bin/env bash
# Run on a machine WITH network: download the wheels scripts/gpu_smoke.sh installs on the GPU machine
# (Python 3.12, manylinux x86_64; that image already has torch, transformers, safetensors, tokenizers,
# numpy, matplotlib, rich, pyyaml, pytest). Carry ./wheels (the device tool's `carry`).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d wheels --no-deps \
  pydantic==2.14.4 "pydantic-core" annotated-types typing-inspection typing-extensions \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 sympy mpmath \
  httpx==0.28.1 httpcore h11 anyio sniffio idna certifi
ls wheels
