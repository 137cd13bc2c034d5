#!/usr/bin/env python3
"""The work and the checks of ``scripts/gpu_smoke.sh``, one subcommand per stage; each check prints one
JSON line ``{"check": NAME, "ok": ..., ...}`` (the stage's log may hold warnings after it: the script
reads the last line that starts with ``{"check"``). Kept out of the shell script so that tests import
it (tests/test_gpu_smoke.py). Only the standard library at import time.

    gpu_smoke.py install WHEELS SITE DEVICE   the carried wheels the image lacks, into SITE; the install check
    gpu_smoke.py model OUT SMALL DEVICE TOKENS   a peaked random Qwen2-0.5B-shaped model whose EOS is likely
    gpu_smoke.py probe PROBE_JSON              the probe's mismatch, ordered by precision
    gpu_smoke.py train RUN NAME STEPS PRECISION   a torchrun run's metrics
    gpu_smoke.py gradient RUN MODEL            non-zero gradients, and the final checkpoint's weights moved
    gpu_smoke.py packed PACKED_RUN PADDED_RUN  one packed and one padded bf16 step from the same seed agree
    gpu_smoke.py emit NAME LOG RC              the stage's check line (the last one of its log), or its failure
    gpu_smoke.py summary CHECKS NAME...        every check ANDed; exit status 0 iff ok
    gpu_smoke.py apis [--sources DIR]          the torch/transformers APIs the smoke runs on exist (here, or in
                                               the unpacked wheels under DIR: read, not imported)
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151936  # Qwen2-0.5B's ids: the output layer (and its memory) of the real model
#: what every dry run and GPU run checks: the modules it needs besides the image's own
NEEDED = ("torch", "transformers", "safetensors", "yaml", "pydantic", "math_verify", "httpx", "unison")


def line(check: str, ok: bool, **kw) -> str:
    return json.dumps({"check": check, "ok": bool(ok), **kw})


# ----------------------------------------------------------------------------------------- install
def wheel_dist(wheel: Path) -> str:
    """The distribution a wheel file installs (its name's first field, PEP 427)."""
    return wheel.name.split("-")[0]


def missing_wheels(wheels: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """The wheels whose distribution this Python cannot find (on sys.path, the target folder included),
    and the version it has of each of the others (those stay as the image has them)."""
    from importlib import metadata

    todo, have = [], {}
    for w in sorted(wheels):
        try:
            have[wheel_dist(w)] = metadata.version(wheel_dist(w))
        except metadata.PackageNotFoundError:
            todo.append(w)
    return todo, have


def install(wheel_dir: Path, site: Path) -> dict:
    """Install the carried wheels this Python lacks into ``site`` (a folder on PYTHONPATH: the image's own
    environment is never written to), without dependencies or an index."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    todo, have = missing_wheels(wheels)
    site.mkdir(parents=True, exist_ok=True)
    if todo and _has_pip():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
               *map(str, todo)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"pip install --target {site} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    elif todo:
        for w in todo:
            unpack_wheel(w, site)
    return {"installed": [wheel_dist(w) for w in todo], "image_has": have}


def _has_pip() -> bool:
    import importlib.util

    return importlib.util.find_spec("pip") is not None


def unpack_wheel(wheel: Path, site: Path) -> None:
    """What ``pip install --target`` does with a wheel, for an image without pip: its files into ``site``
    (``*.data/purelib`` and ``platlib`` too; scripts and headers are not needed here)."""
    import shutil
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for data in site.glob("*.data"):
        for kind in ("purelib", "platlib"):
            for item in (data / kind).glob("*") if (data / kind).is_dir() else []:
                shutil.move(str(item), str(site / item.name))
        shutil.rmtree(data)


def environment(device: str) -> dict:
    """What this Python imports, and from where: unison must be the tree's (no install)."""
    versions, errors = {}, {}
    for name in NEEDED:
        try:
            mod = __import__(name)
            versions[name] = str(getattr(mod, "__version__", "?"))
        except Exception as e:  # noqa: BLE001 - reported, not raised
            errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
    out = {"versions": versions, "import_errors": errors}
    if "unison" in versions:
        import unison

        out["unison_from_tree"] = Path(unison.__file__).resolve().parent == ROOT / "unison"
    if "torch" in versions:
        import torch

        out["cuda"] = torch.cuda.is_available()
        out["gpu"] = torch.cuda.get_device_name(0) if out["cuda"] else None
    out["missing_apis"] = missing_apis()
    out["ok"] = (not errors and out.get("unison_from_tree", False) and not out["missing_apis"]
                 and (device != "cuda" or out.get("cuda", False)))
    return out


# -------------------------------------------------------------- the APIs the smoke's code paths use
#: ``module:object[.attribute]`` and the keyword arguments unison passes, for every torch and transformers
#: API on the smoke's paths (native engine on Qwen2's fast path, learner, packed attention, FSDP2 under
#: torchrun, fp16 scaler, checkpoints): ``apis`` checks them on the image before anything runs on it, and
#: against the image's versions' sources here (``--sources``). tests/test_gpu_smoke.py checks that every
#: ``from torch... import`` / ``from transformers... import`` of the package is listed.
APIS: dict[str, tuple[str, ...]] = {
    "torch.distributed:init_process_group": ("backend", "timeout", "device_id"),
    "torch.distributed:destroy_process_group": (),
    "torch.distributed:is_initialized": (),
    "torch.distributed:all_gather_object": (),
    "torch.distributed:broadcast_object_list": ("src",),
    "torch.distributed:all_reduce": ("op",),
    "torch.distributed:barrier": (),
    "torch.distributed:DistError": (),
    "torch.distributed.run:main": (),
    "torch.distributed.device_mesh:init_device_mesh": ("mesh_dim_names",),
    "torch.distributed.fsdp:fully_shard": ("mesh", "mp_policy"),
    "torch.distributed.fsdp:MixedPrecisionPolicy": ("param_dtype", "reduce_dtype"),
    "torch.distributed.fsdp.sharded_grad_scaler:ShardedGradScaler": ("init_scale", "growth_interval"),
    "torch.distributed.tensor:DTensor.full_tensor": (),
    "torch.distributed.tensor:DTensor.to_local": (),
    "torch.distributed.checkpoint:save": ("checkpoint_id",),
    "torch.distributed.checkpoint:load": ("checkpoint_id",),
    "torch.distributed.checkpoint.state_dict:StateDictOptions": ("full_state_dict", "cpu_offload", "strict",
                                                                 "broadcast_from_rank0"),
    "torch.distributed.checkpoint.state_dict:get_model_state_dict": ("options",),
    "torch.distributed.checkpoint.state_dict:set_model_state_dict": ("options",),
    "torch.distributed.checkpoint.state_dict:get_optimizer_state_dict": (),
    "torch.distributed.checkpoint.state_dict:set_optimizer_state_dict": (),
    "torch.amp:GradScaler": ("init_scale", "growth_factor", "backoff_factor", "growth_interval"),
    "torch.func:functional_call": (),
    "torch.utils.checkpoint:checkpoint": ("use_reentrant",),
    "torch.nn.functional:scaled_dot_product_attention": ("attn_mask", "scale", "enable_gqa"),
    "torch.nn.utils:clip_grad_norm_": (),
    "torch.cuda:max_memory_allocated": (),
    "torch.cuda:reset_peak_memory_stats": (),
    "torch.cuda:set_device": (),
    "torch.cuda:empty_cache": (),
    "torch.utils.tensorboard:SummaryWriter": (),
    "torch:compile": ("dynamic",),
    "torch.library:Library": (),
    "torch._dynamo.utils:compilation_time_metrics": (),  # unison/compilation.py: seconds spent compiling
    "transformers.models.qwen2.configuration_qwen2:Qwen2Config": (),
    "transformers.models.qwen2.modeling_qwen2:Qwen2ForCausalLM": (),
    "transformers.models.qwen2.modeling_qwen2:apply_rotary_pos_emb": (),
    "transformers.models.qwen2.modeling_qwen2:Qwen2Attention.head_dim": (),
    "transformers.models.qwen2.modeling_qwen2:Qwen2Attention.scaling": (),
    "transformers.models.qwen2.modeling_qwen2:Qwen2Model.rotary_emb": (),
    "transformers.models.llama.configuration_llama:LlamaConfig": (),  # the built-in tiny model
    "transformers.models.llama.modeling_llama:LlamaForCausalLM": (),
    "transformers.models.auto.configuration_auto:AutoConfig": (),
    "transformers.models.auto.modeling_auto:AutoModelForCausalLM": (),
    "transformers.models.auto.modeling_auto:MODEL_FOR_CAUSAL_LM_MAPPING": (),
    "transformers.models.auto.tokenization_auto:AutoTokenizer": (),
    "transformers.tokenization_utils_tokenizers:PreTrainedTokenizerFast": (),
    "transformers.cache_utils:DynamicCache": ("config",),
    # exact mode's hybrids: the gradient side of their recurrent scans, read off the model's own module
    # (unison/exact_ssm.py, unison/exact_gdn.py)
    "transformers.models.mamba2.modeling_mamba2:mamba2_chunk_scan": ("D", "dt_bias", "dt_softplus", "dt_limit"),
    "transformers.models.nemotron_h.modeling_nemotron_h:mamba2_chunk_scan": ("D", "dt_bias", "dt_softplus",
                                                                            "dt_limit"),
    "transformers.models.qwen3_next.modeling_qwen3_next:torch_chunk_gated_delta_rule": ("g", "beta",
                                                                                     "use_qk_l2norm_in_kernel"),
    "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS.register": (),
    "transformers.masking_utils:ALL_MASK_ATTENTION_FUNCTIONS.register": (),
    "transformers.masking_utils:sdpa_mask": (),
    "transformers.integrations.sdpa_attention:sdpa_attention_forward": (),
    "transformers.utils.logging:set_verbosity_error": (),
    "transformers.utils.logging:disable_progress_bar": (),
    "transformers.utils:get_json_schema": (),  # tools given as Python functions (unison/chat.py)
}


def _takes(fn, names: tuple[str, ...]) -> list[str]:
    """The keyword arguments of ``names`` that ``fn`` (a function or class) cannot take."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # a builtin without a signature: existence is what can be checked
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return []
    return [n for n in names if n not in sig.parameters]


def missing_apis() -> list[str]:
    """The entries of :data:`APIS` this Python does not have (or whose keyword arguments it lacks)."""
    import importlib

    out = []
    for spec, kwargs in APIS.items():
        mod_name, path = spec.split(":")
        try:
            obj = importlib.import_module(mod_name)
            parts = path.split(".")
            for i, part in enumerate(parts):
                if i == len(parts) - 1 and i > 0 and isinstance(obj, type) and part not in dir(obj):
                    if not _sets_attribute(obj, part):  # an instance attribute its __init__ sets
                        raise AttributeError(part)
                    obj = None
                    break
                obj = getattr(obj, part)
        except Exception as e:  # noqa: BLE001 - ImportError, AttributeError: either is "missing"
            out.append(f"{spec} ({type(e).__name__})")
            continue
        bad = _takes(obj, kwargs) if obj is not None and kwargs else []
        if bad:
            out.append(f"{spec} (no keyword {', '.join(bad)})")
    return out


def _sets_attribute(cls: type, name: str) -> bool:
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return False
    return _class_sets(tree.body[0], name)


def _class_sets(node: ast.ClassDef, name: str) -> bool:
    """Whether a class body defines ``name`` or one of its methods assigns ``self.<name>``."""
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.name == name:
            return True
        targets = sub.targets if isinstance(sub, ast.Assign) else \
            [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Name) and t.id == name:
                return True
            if isinstance(t, ast.Attribute) and t.attr == name and getattr(t.value, "id", None) == "self":
                return True
    return False


class Sources:
    """Reads names out of unpacked wheels (``DIR/torch/...``, ``DIR/transformers/...``) without importing
    them: a module's file (``.py``, else its ``.pyi`` stub), what it defines at top level (following
    ``from x import y`` re-exports), a class's methods, attributes and bases, a function's parameters."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = self.root.joinpath(*module.split("."))
            found = None
            for f in (base / "__init__.py", base.with_suffix(".py"), base / "__init__.pyi", base.with_suffix(".pyi")):
                if f.is_file():
                    found = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
                    break
            self._trees[module] = found
        return self._trees[module]

    def define(self, module: str, name: str, depth: int = 0):
        """``(module, node)`` defining ``name`` in ``module``, or None."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        nodes = list(tree.body)
        for n in list(nodes):  # one level into if/try blocks (TYPE_CHECKING, optional imports)
            if isinstance(n, (ast.If, ast.Try)):
                nodes += n.body + getattr(n, "orelse", []) + [x for h in getattr(n, "handlers", []) for x in h.body]
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
                return module, n
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
                return module, n
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
                return module, n
        for n in nodes:
            if isinstance(n, ast.ImportFrom):
                for a in n.names:
                    if a.name == "*":  # from x import *: whatever x defines
                        found = self.define(self._resolve(module, n), name, depth + 1)
                        if found is not None:
                            return found
                    elif (a.asname or a.name) == name:
                        src = self._resolve(module, n)
                        if self.tree(f"{src}.{a.name}") is not None:  # a submodule
                            return f"{src}.{a.name}", self.tree(f"{src}.{a.name}")
                        return self.define(src, a.name, depth + 1)
        return None

    def _resolve(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        is_pkg = self.root.joinpath(*module.split("."), "__init__.py").is_file()
        parts = module.split(".")
        base = parts if is_pkg else parts[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _class_of(self, module: str, node):
        """The class an assignment instantiates (``X: C = C()``), for attribute look-ups."""
        value = getattr(node, "value", None)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            return self.define(module, value.func.id)
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
        if depth > 8:
            return None
        for n in cls.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
                return n
        if _class_sets(cls, name):
            return cls
        for b in cls.bases:
            if isinstance(b, ast.Name):
                found = self.define(module, b.id)
                if found and isinstance(found[1], ast.ClassDef):
                    m = self.member(found[0], found[1], name, depth + 1)
                    if m is not None:
                        return m
        return None

    def params(self, module: str, node) -> set[str] | None:
        """Keyword names a function or class takes (None: takes any, or cannot tell)."""
        if isinstance(node, ast.ClassDef):
            init = self.member(module, node, "__init__")
            if isinstance(init, ast.FunctionDef):
                return self.params(module, init)
            fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            return fields or None  # a dataclass: its annotated fields
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            if a.kwarg is not None:
                return None
            return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        if isinstance(node, ast.Assign):  # X = _add_docstr(torch._C._nn.X, ...): the stub of the builtin
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute):
                    chain, cur = [], sub
                    while isinstance(cur, ast.Attribute):
                        chain.insert(0, cur.attr)
                        cur = cur.value
                    if isinstance(cur, ast.Name) and len(chain) > 1:
                        found = self.define(".".join([cur.id] + chain[:-1]), chain[-1])
                        if found and not isinstance(found[1], ast.Assign):
                            return self.params(*found)
        return None

    def check(self, spec: str, kwargs: tuple[str, ...]) -> str | None:
        """None when ``spec`` exists in these sources with ``kwargs``; else why not."""
        mod_name, path = spec.split(":")
        parts = path.split(".")
        found = self.define(mod_name, parts[0])
        if found is None:
            return "not defined"
        module, node = found
        for part in parts[1:]:
            cls = (module, node) if isinstance(node, ast.ClassDef) else self._class_of(module, node)
            if cls is None or not isinstance(cls[1], ast.ClassDef):
                return f"cannot see the attributes of {parts[0]}"
            node = self.member(cls[0], cls[1], part)
            if node is None:
                return f"no attribute {part}"
            module = cls[0]
        if kwargs:
            names = self.params(module, node)
            missing = [k for k in kwargs if names is not None and k not in names]
            if missing:
                return f"no keyword {', '.join(missing)}"
        return None


def check_sources(root: Path) -> dict:
    """:data:`APIS` against unpacked wheels under ``root`` (torch/, transformers/ and their versions)."""
    src = Sources(root)
    versions = {}
    for pkg, f in (("torch", "torch/version.py"), ("transformers", "transformers/__init__.py")):
        p = root / f
        if p.is_file():
            for ln in p.read_text().splitlines():
                if ln.startswith("__version__"):
                    versions[pkg] = ln.split("=", 1)[1].strip().strip("'\"")
    missing = {spec: why for spec, kw in APIS.items() if (why := src.check(spec, kw)) is not None}
    return {"versions": versions, "checked": len(APIS), "missing": missing}


# ------------------------------------------------------------------------------------------ model
def build_model(out: Path, small: bool, device: str, tokens: int) -> dict:
    """A random Qwen2-0.5B-shaped model (the real output layer of 151,936 ids; ``small``: narrow and
    2 layers) with a tokenizer that decodes every id, made peaked (its output layer scaled until the mean
    next-token entropy is 0.5-3 nats: near-uniform outputs make every precision look alike), and ending
    its responses at varied lengths: its generation config names, beside the EOS, a random 2/``tokens``
    of the ids as stop tokens (as chat models name several: Qwen2.5 two), so a response stops at each
    token with probability ≈ 2/``tokens`` — packing then has rows of different lengths, the length reward
    varies. With one EOS of 151,936 ids no response would end, and one EOS row made likely stops them
    all at once or never (whether it is likely depends on the context). The lengths of 8 sampled
    responses are printed."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from unison.models import build_char_tokenizer

    t0 = time.time()
    tok = build_char_tokenizer(vocab_size=VOCAB)
    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
    if small:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfg = Qwen2Config(vocab_size=VOCAB, **shape, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-6,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a GPU fills 630 M random weights in no time)
        model = Qwen2ForCausalLM(cfg).eval()
    text = torch.tensor([tok("12+35=47. The quick brown fox jumps")["input_ids"]], device=device)

    def entropy():
        with torch.no_grad():
            lp = torch.log_softmax(model(text).logits.float(), -1)
        return float(-(lp.exp() * lp).sum(-1).mean())

    scale, h = 1.0, entropy()
    for _ in range(40):  # scale the output layer until the next-token distributions are peaked
        if 0.5 <= h <= 3.0:
            break
        f = 1.6 if h > 3.0 else 0.75
        with torch.no_grad():
            model.lm_head.weight.mul_(f)
        scale *= f
        h = entropy()
    stops = stop_ids(tok, 2.0 / tokens)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = tok.pad_token_id
    prompt = torch.tensor([tok("12+35=")["input_ids"]], device=device)
    with torch.no_grad():
        torch.manual_seed(1)
        seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=tokens,
                              num_return_sequences=8)
    lengths = sorted(_response_length(row.tolist()[prompt.shape[1]:], set(stops)) for row in seqs)
    model.to("cpu").save_pretrained(out)
    tok.save_pretrained(out)
    special = set(tok.all_special_ids)
    decodes = sum(1 for i, t in enumerate(tok.batch_decode([[i] for i in range(len(tok))])) if t or i in special)
    return {"check": "model", "ok": 0.5 <= h <= 3.0 and decodes == VOCAB and lengths[0] < lengths[-1],
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "mean_entropy_nats": round(h, 3), "lm_head_scale": round(scale, 3), "ids_that_decode": decodes,
            "stop_ids": len(stops), "sampled_lengths": lengths, "max_new_tokens": tokens,
            "seconds": round(time.time() - t0, 1)}


def stop_ids(tok, fraction: float) -> list[int]:
    """The EOS and ``fraction`` of the other non-special ids, drawn at random (seed 0)."""
    import torch

    special = sorted(set(tok.all_special_ids))
    first = max(special) + 1
    g = torch.Generator().manual_seed(0)
    drawn = torch.randperm(len(tok) - first, generator=g)[:round(fraction * (len(tok) - first))] + first
    return sorted({int(tok.eos_token_id), *drawn.tolist()})


def _response_length(ids: list[int], stops: set[int]) -> int:
    """Tokens up to and including the first stop id (the rest of a finished row is padding)."""
    for i, t in enumerate(ids):
        if t in stops:
            return i + 1
    return len(ids)


# ------------------------------------------------------------------------------------------ checks
def probe_check(probe_json: Path) -> dict:
    """Both learner numerics, three precisions: token k3 ordered bf16 > fp16 > fp32."""
    res = json.loads(probe_json.read_text())["results"]
    k3 = {(r["precision"], r["param_dtype"]): r["mismatch/k3"] for r in res}
    ordered = len(res) == 6 and all(k3[("bf16", p)] > k3[("fp16", p)] > k3[("fp32", p)] for p in ("fp32", "compute"))
    return {"check": "probe", "ok": ordered,
            "token_k3": {f"{a}/{b}": v for (a, b), v in k3.items()},
            "seq_kl_k3": {f"{r['precision']}/{r['param_dtype']}": r["mismatch/seq_kl_k3"] for r in res},
            "tokens": {r["precision"]: r["mismatch/num_tokens"] for r in res if r["param_dtype"] == "fp32"},
            "mean_response_length": {r["precision"]: round(r["mean_response_length"], 1) for r in res
                                     if r["param_dtype"] == "fp32"}}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def train_check(run: Path, name: str, steps: int, precision: str) -> dict:
    """A torchrun run's metrics: every step logged, rewards that vary within the step (else the
    gradient is zero whatever the backward does), a finite non-zero gradient norm wherever an optimizer
    step was applied, at least one applied, and the fp16 loss scale that the skipped steps imply
    (2^16 halved per skip; it grows only after 400 clean steps)."""
    rows = read_rows(run / "metrics.jsonl")
    last = rows[-1] if rows else {}
    skipped = last.get("optim/skipped_steps", 0)
    applied = sum(r.get("optim/steps", 0) for r in rows)
    scale = last.get("optim/loss_scale")
    want_scale = 2.0 ** 16 * 0.5 ** skipped if precision == "fp16" else 1.0
    varied = bool(rows) and all((r.get("reward/std") or 0) > 0 for r in rows)
    grads = all(_finite(r.get("optim/grad_norm")) and r["optim/grad_norm"] > 0 for r in rows if r.get("optim/steps"))
    tok = [r.get("mismatch/num_tokens", 0) for r in rows]

    def per_s(key):
        return [round(t / r[key]) if r.get(key) else None for t, r in zip(tok, rows)]

    return {"check": f"train/{name}",
            "ok": len(rows) == steps and applied > 0 and varied and grads and scale == want_scale,
            "steps": len(rows), "optimizer_steps": applied, "skipped_steps": skipped, "loss_scale": scale,
            "reward_std": [round(r.get("reward/std", 0.0), 4) for r in rows],
            "grad_norm": [r.get("optim/grad_norm") for r in rows],
            "token_k3": [r.get("mismatch/k3") for r in rows],
            "response_length_mean": [round(r.get("response_length/mean", 0.0), 1) for r in rows],
            "step_s": [round(r.get("time/step_s", 0.0), 2) for r in rows],
            "decode_tokens_per_s": per_s("time/generate_s"), "update_tokens_per_s": per_s("time/update_s"),
            # grad-noise telemetry is off in the smoke (train.grad_noise: false): on, it keeps an fp32 copy of the
            # gradient and makes a second one per micro-batch (learner.GradNoiseProbe: 8 bytes per parameter at
            # its peak, +4.7 GiB on this model), which these peaks would include
            "cuda_peak_gib_per_step": [round(r["memory/cuda_max_allocated_gib"], 2)
                                       if _finite(r.get("memory/cuda_max_allocated_gib")) else None for r in rows],
            "grad_noise_telemetry": False}


def gradient_check(run: Path, model_dir: Path) -> dict:
    """The gradient was non-zero and the weights moved: every applied step had a finite, positive gradient
    norm, and every tensor of the run's final checkpoint differs from the model it started from. Also that
    the run kept only its final checkpoint (checkpoint.keep: 1, no periodic ones)."""
    import torch
    from safetensors import safe_open

    from unison.checkpoint import complete

    rows = read_rows(run / "metrics.jsonl")
    norms = [r.get("optim/grad_norm") for r in rows if r.get("optim/steps")]
    ckpts = complete(run / "checkpoints")
    if not ckpts:
        return {"check": "train/gradient", "ok": False, "why": f"no checkpoint in {run / 'checkpoints'}"}

    def tensors(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                out.update({k: (f, k) for k in h.keys()})
        return out

    def load(ref):
        with safe_open(str(ref[0]), "pt") as h:
            return h.get_tensor(ref[1]).float()

    before, after = tensors(model_dir), tensors(ckpts[-1] / "model")
    moved, still, total_abs, count, biggest = 0, [], 0.0, 0, 0.0
    for name in sorted(before.keys() & after.keys()):
        d = (load(after[name]) - load(before[name])).abs()
        if float(d.max()) > 0:
            moved += 1
        else:
            still.append(name)
        total_abs += float(d.sum(dtype=torch.float64))
        count += d.numel()
        biggest = max(biggest, float(d.max()))
    same_keys = before.keys() == after.keys()
    ok = (bool(norms) and all(_finite(g) and g > 0 for g in norms) and same_keys and not still
          and len(ckpts) == 1)
    return {"check": "train/gradient", "ok": ok, "grad_norm": norms,
            "tensors_moved": f"{moved}/{len(before)}", "unmoved": still[:5], "same_names": same_keys,
            "mean_abs_change": total_abs / max(count, 1), "max_abs_change": biggest,
            "checkpoints_kept": [p.name for p in ckpts]}


def _rollouts(run: Path, step: int = 1) -> list[dict]:
    return read_rows(run / "rollouts" / f"step_{step:06d}.jsonl")


#: packed vs padded at step 1, same rollouts: what bf16 rounding alone can move (see packed_check)
K3_RATIO_MAX = 3.0
ENTROPY_REL_MAX = 0.02
LOSS_REL_MAX, LOSS_ABS_FLOOR = 0.05, 1e-3


def packed_check(packed: Path, padded: Path) -> dict:
    """One packed and one padded bf16 step from the same seed: the rollouts (before any update) must be
    the same tokens, their lengths must vary (else packing has nothing to pack), and the learner's loss,
    entropy and token k3 (μ against the score pass, the only part that packing changes) must agree within
    bf16 noise. Packing changes the order of the sums (one row of many responses, one attention call each,
    other micro-batches) and so bf16's rounding, no more: k3 (itself bf16 noise, μ vs π) within a factor
    of K3_RATIO_MAX, the entropy within ENTROPY_REL_MAX relative, the loss within LOSS_REL_MAX relative (or
    LOSS_ABS_FLOOR, for a loss near 0). The CPU dry run measured 1.01, 0.04% and 0.13%. Attention across
    responses, a wrong position or a dropped token moves k3 and the entropy by orders of magnitude more."""
    a, b = read_rows(packed / "metrics.jsonl"), read_rows(padded / "metrics.jsonl")
    ra, rb = _rollouts(packed), _rollouts(padded)
    if not a or not b or not ra or not rb:
        return {"check": "train/packed_vs_padded", "ok": False, "why": "a run has no step 1 (metrics or rollouts)"}
    a, b = a[0], b[0]
    same = [r["token_ids"] for r in ra] == [r["token_ids"] for r in rb]
    lengths = [len(r["token_ids"]) for r in ra]
    k3a, k3b = a.get("mismatch/k3"), b.get("mismatch/k3")
    ent_a, ent_b = a.get("policy/entropy"), b.get("policy/entropy")
    loss_a, loss_b = a.get("policy/loss"), b.get("policy/loss")
    nums = [k3a, k3b, ent_a, ent_b, loss_a, loss_b]
    finite = all(_finite(x) for x in nums)
    ratio = max(k3a, k3b) / min(k3a, k3b) if finite and min(k3a, k3b) > 0 else math.inf
    ent_rel = abs(ent_a - ent_b) / max(abs(ent_b), 1e-12) if finite else math.inf
    loss_abs = abs(loss_a - loss_b) if finite else math.inf
    loss_max = max(LOSS_REL_MAX * abs(loss_b), LOSS_ABS_FLOOR) if finite else 0.0
    ok = (same and max(lengths) > min(lengths) and ratio <= K3_RATIO_MAX and ent_rel <= ENTROPY_REL_MAX
          and loss_abs <= loss_max)
    return {"check": "train/packed_vs_padded", "ok": ok, "same_rollouts": same,
            "response_lengths": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1),
                                 "max": max(lengths), "n": len(lengths)},
            "token_k3": {"packed": k3a, "padded": k3b, "ratio": ratio, "max_ratio": K3_RATIO_MAX},
            "entropy": {"packed": ent_a, "padded": ent_b, "rel_diff": ent_rel, "max_rel": ENTROPY_REL_MAX},
            "loss": {"packed": loss_a, "padded": loss_b, "abs_diff": loss_abs, "max_abs": loss_max},
            "update_s": {"packed": a.get("time/update_s"), "padded": b.get("time/update_s")},
            "cuda_peak_gib": {"packed": a.get("memory/cuda_max_allocated_gib"),
                              "padded": b.get("memory/cuda_max_allocated_gib")}}


# ------------------------------------------------------------------------------ the script's plumbing
def last_check(log: Path) -> dict | None:
    """The last line of ``log`` that starts with ``{"check"`` and parses (warnings may follow it)."""
    if not log.is_file():
        return None
    for ln in reversed(log.read_text(errors="replace").splitlines()):
        if ln.startswith('{"check"'):
            try:
                return json.loads(ln)
            except json.JSONDecodeError:
                continue
    return None


def emit(name: str, log: Path, rc: int) -> dict:
    """The stage's check line: the last one in its log when the stage exited 0 and it names this stage;
    otherwise a failing line saying why (exit status, time-out, no check line)."""
    found = last_check(log)
    if rc == 0 and found is not None and found.get("check") == name:
        return found
    why = "timed out" if rc in (124, 137) else f"exit status {rc}" if rc else "no check line in its log"
    out = {"check": name, "ok": False, "why": why, "log": str(log)}
    if found is not None and found.get("check") == name:
        out["reported"] = found
    return out


def summary(checks: Path, want: list[str]) -> dict:
    """Every check ANDed: each of ``want`` present and every line ok; a line that does not parse fails."""
    seen, failed, unreadable = set(), [], []
    for i, ln in enumerate(checks.read_text(errors="replace").splitlines() if checks.is_file() else [], 1):
        if not ln.strip():
            continue
        try:
            c = json.loads(ln)
            name, ok = c["check"], c["ok"] is True
        except (json.JSONDecodeError, KeyError, TypeError):
            unreadable.append(i)
            continue
        seen.add(name)
        if not ok:
            failed.append(name)
    missing = [w for w in want if w not in seen]
    return {"check": "summary", "ok": not missing and not failed and not unreadable, "missing": missing,
            "failed": failed, "unreadable_lines": unreadable}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("install")
    s.add_argument("wheels", type=Path)
    s.add_argument("site", type=Path)
    s.add_argument("device")
    s = sub.add_parser("env")
    s.add_argument("device")
    s = sub.add_parser("model")
    s.add_argument("out", type=Path)
    s.add_argument("small")
    s.add_argument("device")
    s.add_argument("tokens", type=int)
    s = sub.add_parser("probe")
    s.add_argument("probe_json", type=Path)
    s = sub.add_parser("train")
    s.add_argument("run", type=Path)
    s.add_argument("name")
    s.add_argument("steps", type=int)
    s.add_argument("precision")
    s = sub.add_parser("gradient")
    s.add_argument("run", type=Path)
    s.add_argument("model", type=Path)
    s = sub.add_parser("packed")
    s.add_argument("packed", type=Path)
    s.add_argument("padded", type=Path)
    s = sub.add_parser("emit")
    s.add_argument("name")
    s.add_argument("log", type=Path)
    s.add_argument("rc", type=int)
    s = sub.add_parser("summary")
    s.add_argument("checks", type=Path)
    s.add_argument("want", nargs="*")
    s = sub.add_parser("apis")
    s.add_argument("--sources", type=Path, default=None)
    a = p.parse_args(argv)

    if a.cmd == "install":
        t0 = time.time()
        done = install(a.wheels, a.site)
        # a fresh interpreter: what it imports is what every later stage imports
        r = subprocess.run([sys.executable, __file__, "env", a.device], capture_output=True, text=True)
        try:
            env = json.loads(r.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            env = {"ok": False, "env_error": (r.stderr or r.stdout).strip()[-400:]}
        print(line("install", env.pop("ok"), **done, **env, seconds=round(time.time() - t0, 1)))
    elif a.cmd == "env":
        print(json.dumps(environment(a.device)))
    elif a.cmd == "model":
        print(json.dumps(build_model(a.out, a.small == "1", a.device, a.tokens)))
    elif a.cmd == "probe":
        print(json.dumps(probe_check(a.probe_json)))
    elif a.cmd == "train":
        print(json.dumps(train_check(a.run, a.name, a.steps, a.precision)))
    elif a.cmd == "gradient":
        print(json.dumps(gradient_check(a.run, a.model)))
    elif a.cmd == "packed":
        print(json.dumps(packed_check(a.packed, a.padded)))
    elif a.cmd == "emit":
        print(json.dumps(emit(a.name, a.log, a.rc)))
    elif a.cmd == "summary":
        out = summary(a.checks, a.want)
        print(json.dumps(out))
        return 0 if out["ok"] else 1
    elif a.cmd == "apis":
        if a.sources is None:
            miss = missing_apis()
            print(line("apis", not miss, checked=len(APIS), missing=miss))
            return 0 if not miss else 1
        out = check_sources(a.sources)
        print(line("apis", not out["missing"], **out))
        return 0 if not out["missing"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
