"""The rules of the configuration's named values (precisions, engines, GEMM libraries, thread counts): a leaf that
the modules acting on them import, so the config never imports them."""

from __future__ import annotations

from unison.errors import UnisonError

#: compute precisions of the two engines (torch dtypes: unison.precision.DTYPES)
PRECISIONS = ("fp32", "bf16", "fp16")
#: rollout engines (unison.rollout.make_engine)
ENGINES = ("native", "vllm")
#: libraries of the CPU's fp32 matmuls (unison.gemm)
GEMM_CHOICES = ("auto", "blas", "onednn")
#: Inductor compilation of the engine's and the learner's layers (unison.compilation)
COMPILE_CHOICES = ("auto", "measure", "on", "off", "engine", "learner")


def parse_precision(name: str) -> str:
    """Validate a precision name; return it normalised."""
    key = str(name).strip().lower()
    aliases = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
    key = aliases.get(key, key)
    if key in ("fp8", "int8", "int4", "e4m3", "float8"):
        raise UnisonError(f"precision '{name}' is not a compute precision: {key} is a weight format of the rollout "
                          f"engine — set rollout.quantization={'fp8' if key in ('e4m3', 'float8') else key} and keep "
                          f"precision one of fp32, bf16, fp16")
    if key not in PRECISIONS:
        raise UnisonError(f"unknown precision '{name}': choose one of fp32, bf16, fp16")
    return key


def parse_threads(value) -> int | str:
    """``auto`` or a positive integer."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or str(n) != text:
        raise UnisonError(f"threads '{value}' is not auto or a positive integer: write e.g. threads=1 or "
                          f"threads=auto")
    return n


def parse_gemm(value) -> str:
    """One library for both roles, or ``LEARNER/ENGINE`` (each one of them; equal parts read as one)."""
    text = str(value).strip().lower().replace(" ", "")
    parts = text.split("/")
    if len(parts) > 2 or any(p not in GEMM_CHOICES for p in parts):
        raise UnisonError(f"gemm '{value}' is not one of {', '.join(GEMM_CHOICES)} (or LEARNER/ENGINE, e.g. "
                          f"blas/onednn): write e.g. gemm=auto")
    return parts[0] if len(parts) == 1 or parts[0] == parts[1] else text


def parse_compile(value) -> str:
    """``auto``, ``measure``, ``on``, ``off``, or one side: ``engine`` / ``learner`` (YAML's true/false read as on/off)."""
    text = {True: "on", False: "off"}.get(value, str(value).strip().lower()) if isinstance(value, bool) \
        else str(value).strip().lower()
    if text not in COMPILE_CHOICES:
        raise UnisonError(f"compile '{value}' is not one of {', '.join(COMPILE_CHOICES)}: write e.g. compile=auto")
    return text


def parse_engine(name: str) -> str:
    key = str(name).strip().lower()
    if key not in ENGINES:
        raise UnisonError(f"unknown engine '{name}': choose one of {', '.join(ENGINES)}")
    return key
