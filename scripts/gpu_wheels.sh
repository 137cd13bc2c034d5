#!/usr/bin/env bash
# Run on a machine WITH network: download the wheels scripts/gpu_smoke.sh may need on the GPU machine
# (Python 3.12, manylinux x86_64; that image already has torch, transformers, safetensors, tokenizers,
# numpy, matplotlib, rich, pyyaml, pytest, httpx and its dependencies, sympy). Carry ./wheels (the device
# tool's `carry`; about 11 MB): the smoke installs only those whose package the image lacks, into a folder
# of their own on PYTHONPATH. Every wheel is pinned: pydantic-core must be the build pydantic 2.14.4 was
# released against.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any -d wheels --no-deps \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 sympy==1.14.0 mpmath==1.3.0 \
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1
ls wheels
