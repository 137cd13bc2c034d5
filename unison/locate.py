"""``unison probe --locate``: where in the network the rollout engine and the learner first part.

For one batch of sampled responses, the engine's prefill (its weights, dtype, kernels and — for the fused Llama
path — its own attention) and the learner's forward (fp32 parameters under autocast, as it scores) run over the same
tokens with hooks on the same modules. At every op of the decoder —

    embed, then per layer i: L{i}.attn_norm, L{i}.attn (o_proj's output), L{i}.mlp_norm, L{i}.mlp (down_proj's
    output), L{i}.out (the residual stream leaving the layer), then norm (the final norm) and head (the logits);
    a hybrid's linear-attention and state-space layers: L{i}.in_proj, L{i}.scan, L{i}.gate, L{i}.linear (:func:`taps`)

— the relative error ‖h_engine − h_learner‖ / ‖h_learner‖ over the positions that predict response tokens (the
tokens the mismatch is measured on), and the first op whose error exceeds its precision's rounding: the unit
roundoff u of the engine's compute dtype (bf16 2⁻⁸, fp16 2⁻¹¹, fp32 2⁻²⁴) times ``ROUNDING_SLACK``. At the head,
the full-vocabulary KL(μ ‖ π) per position (not only the sampled token's log-ratio), at the sampling temperature.

The error at an op includes what reached it from the ops before (the two forwards run side by side, not op by op
on shared inputs): where it starts is the first row above the line, how it grows is the rows after it.
"""

from __future__ import annotations

import contextlib

import torch

from unison.errors import UnisonError
from unison.models import FAST_PATH_TYPES, RECURRENT_RUN
from unison.models import logit_transform
from unison.precision import autocast

#: unit roundoff of each compute dtype: half the distance from 1 to the next representable number
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
#: an op is "above its precision's rounding" when its relative error exceeds this many unit roundoffs: one rounding
#: of an output gives at most u per element; two engines that round the same values independently (different
#: kernels, a different order of summation) differ by a few u, so the line sits above that
ROUNDING_SLACK = 4.0


def check_locatable(model) -> None:
    """Refuse a model whose decoder is not one whose ops it names: the Llama family (Llama, Mistral, Qwen2, Qwen3 —
    the native engine's fused path), where the modules below mean what the op names say, and the hybrid and
    state-space models that run (:data:`~unison.models.RECURRENT_RUN`)."""
    kind = getattr(model.config, "model_type", "?")
    layers = getattr(_core(model), "layers", None)
    if kind in RECURRENT_RUN and layers is not None:
        return
    if kind not in FAST_PATH_TYPES or layers is None or not hasattr(layers[0].mlp, "down_proj"):
        raise UnisonError(f"--locate names the ops of a dense Llama-family decoder ({', '.join(FAST_PATH_TYPES)}: "
                          f"embed_tokens, input_layernorm, self_attn.o_proj, post_attention_layernorm, mlp.down_proj, "
                          f"norm) or of a hybrid ({', '.join(RECURRENT_RUN)}); model type '{kind}' is not one: drop "
                          f"--locate for this model")


def _core(model):
    """The decoder stack: ``model.model``, or Mamba2's ``backbone``."""
    return getattr(model, "model", None) or getattr(model, "backbone", None)


def _first(module, *names):
    return next((getattr(module, n) for n in names if getattr(module, n, None) is not None), None)


def taps(model) -> list[tuple[str, object, str]]:
    """Every op --locate reports, in the order the forward runs them: ``(name, module, how)``, ``how`` one of
    ``out`` (the module's output), ``in`` (its first input) and ``in_flat`` (its first input, flattened over heads:
    a gated norm that Gated DeltaNet calls per head). Per layer: its input norm (``attn_norm`` in the Llama family,
    ``norm`` elsewhere); a softmax attention's output (``attn``: o_proj); a linear-attention or state-space mixer's
    input projection (``in_proj``), its scan's output (``scan``: the gated norm's input, where it has one), the scan
    after the gate and norm (``gate``: out_proj's input) and its output (``linear``: out_proj's); the MLP's norm and
    output (``mlp_norm``, ``mlp``: down_proj); ``out``, the residual stream leaving the layer."""
    core = _core(model)
    final = _first(core, "norm", "norm_f", "final_layernorm")
    ops = [("embed", _first(core, "embed_tokens", "embeddings"), "out")]
    for i, layer in enumerate(core.layers):
        norm = _first(layer, "input_layernorm", "norm")
        if i > 0:  # the residual stream entering layer i is the one leaving layer i - 1
            ops.append((f"L{i - 1}.out", norm, "in"))
        ops.append((f"L{i}.attn_norm" if hasattr(layer, "input_layernorm") else f"L{i}.norm", norm, "out"))
        mixer = _first(layer, "linear_attn", "mamba", "mixer")
        attn = _first(layer, "self_attn") or (mixer if hasattr(mixer, "o_proj") else None)
        if attn is not None:
            ops.append((f"L{i}.attn", attn.o_proj, "out"))
        if mixer is not None and hasattr(mixer, "out_proj"):
            ops.append((f"L{i}.in_proj", _first(mixer, "in_proj", "in_proj_qkvz"), "out"))
            if not isinstance(getattr(mixer, "norm", None), (type(None), torch.nn.Identity)):  # (Falcon-H1's unused)
                ops.append((f"L{i}.scan", mixer.norm, "in_flat"))
            ops += [(f"L{i}.gate", mixer.out_proj, "in"), (f"L{i}.linear", mixer.out_proj, "out")]
        mlp = _first(layer, "mlp", "feed_forward") or (mixer if hasattr(mixer, "down_proj") else None)
        mlp_norm = _first(layer, "post_attention_layernorm", "pre_ff_layernorm")
        if mlp_norm is not None:
            ops.append((f"L{i}.mlp_norm", mlp_norm, "out"))
        if hasattr(mlp, "down_proj"):  # (not a mixture of experts: its output is the layer's, in L{i}.out)
            ops.append((f"L{i}.mlp", mlp.down_proj, "out"))
    ops.append((f"L{len(core.layers) - 1}.out", final, "in"))
    return ops + [("norm", final, "out")]


def op_names(model) -> list[str]:
    """Every op --locate reports, in the order the forward runs them (:func:`taps`), then ``head``."""
    return [name for name, _, _ in taps(model)] + ["head"]


@contextlib.contextmanager
def tapped(model, want: torch.Tensor, into: dict[str, torch.Tensor]):
    """Record every op of ``model``'s decoder (:func:`taps`) at the positions ``want`` marks ([B, L] bool) into
    ``into`` (name -> [n, d] fp32 on the CPU) while the context is open. Works on any forward that calls the
    decoder's modules: the Hugging Face forward and the native engine's fused path alike (which calls the norms,
    o_proj and down_proj as modules and may apply the final norm to rows already selected)."""
    n, rows = int(want.sum()), want.numel()

    def keep(name, flat):
        def put(t):
            t = t[0] if isinstance(t, tuple) else t
            if flat and t.dim() == 2 and t.shape[0] % rows == 0:
                t = t.reshape(*want.shape, -1)
            if t.dim() >= 3 and tuple(t.shape[:2]) == tuple(want.shape):
                t = t[want.to(t.device)]
            elif t.shape[0] != n:
                raise RuntimeError(f"--locate: op {name} produced shape {tuple(t.shape)}, expected [B, L, d] or "
                                   f"[{n}, d]")
            into[name] = t.detach().float().cpu()
        return put

    handles = []
    try:
        for name, module, how in taps(model):
            put = keep(name, how == "in_flat")
            if how == "out":
                handles.append(module.register_forward_hook(lambda _m, _a, out, put=put: put(out)))
            else:
                handles.append(module.register_forward_pre_hook(lambda _m, args, put=put: put(args[0])))
        yield into
    finally:
        for h in handles:
            h.remove()


def want_positions(batch) -> torch.Tensor:
    """[B, L] bool: the positions whose hidden state predicts a response token (position t predicts token t + 1)."""
    resp = batch.response_mask.bool()
    want = torch.zeros_like(resp)
    want[:, :-1] = resp[:, 1:]
    return want


@torch.no_grad()
def engine_trace(engine, batch, temperature: float) -> dict[str, torch.Tensor]:
    """The native engine's prefill over ``batch`` (as its ``score`` runs it), every op recorded; ``head`` holds
    its log-probabilities over the whole vocabulary at ``temperature``, [n, V]."""
    if getattr(engine, "name", "") != "native" or engine.exact is not None:
        raise UnisonError("--locate reads the engine's hidden states layer by layer, which only the native engine "
                          "outside exact mode exposes: use --engine native")
    check_locatable(engine.model)
    ids, key_ok = batch.tokens.to(engine.device), batch.attention_mask.to(engine.device).bool()
    want = want_positions(batch).to(engine.device)
    B, L = ids.shape
    pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
    out: dict[str, torch.Tensor] = {}
    with tapped(engine.model, want, out):
        h = engine._backend(B, L, 0).hidden(ids, key_ok, pos, want)
    out["head"] = torch.log_softmax(engine._head(h).float() / temperature, dim=-1).cpu()
    return out


@torch.no_grad()
def learner_trace(scorer, batch, temperature: float) -> dict[str, torch.Tensor]:
    """The learner's forward over ``batch`` in its compute dtype (fp32 parameters under autocast), every op
    recorded; ``head`` as :func:`engine_trace`'s, through the output layer's own matmul (the learner's scoring pass
    takes log π of the sampled token through its fused head, equal to it within fp32 rounding: the ledger's chain
    measures that pass)."""
    model = scorer.model
    check_locatable(model)
    want = want_positions(batch).to(scorer.device)
    out: dict[str, torch.Tensor] = {}
    with tapped(model, want, out), autocast(scorer.device, scorer.compute_dtype):
        res = model.base_model(input_ids=batch.tokens.to(scorer.device),
                               attention_mask=batch.attention_mask.to(scorer.device), use_cache=False)
        h = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
        logits = model.get_output_embeddings()(h[want])
    transform = logit_transform(model.config)
    logits = logits if transform is None else transform(logits)
    out["head"] = torch.log_softmax(logits.float() / temperature, dim=-1).cpu()
    return out


def compare(eng: dict[str, torch.Tensor], lrn: dict[str, torch.Tensor], batch, dtype: torch.dtype,
            ops: list[str]) -> dict:
    """Per op the relative error of the engine against the learner, the first op above the rounding line, and the
    full-vocabulary KL(μ ‖ π) per response position."""
    line = ROUNDING_SLACK * UNIT_ROUNDOFF[dtype]
    rows, first = [], None
    for name in ops:
        e, r = eng[name], lrn[name]
        if name == "head":  # the probabilities, not their logs: a log-prob's error is unbounded where p is tiny
            e, r = e.exp(), r.exp()
        err = float((e - r).norm() / r.norm().clamp(min=1e-30))
        above = err > line
        if above and first is None:
            first = name
        rows.append({"op": name, "rel_error": err, "above": above})
    lp_mu, lp_pi = eng["head"], lrn["head"]
    kl = (lp_mu.exp() * (lp_mu - lp_pi)).sum(-1).clamp(min=0)  # [n], in the order of want's positions
    want = want_positions(batch)
    index = (want.long().cumsum(-1) - 1)[want]  # each position's place in its response
    by_index = torch.zeros(int(index.max()) + 1 if len(index) else 0).index_add_(0, index, kl)
    counts = torch.zeros_like(by_index).index_add_(0, index, torch.ones_like(kl))
    return {"ops": rows, "first_above": first, "rounding_line": line, "dtype": str(dtype).replace("torch.", ""),
            "full_kl_mean": float(kl.mean()) if len(kl) else 0.0, "full_kl_max": float(kl.max()) if len(kl) else 0.0,
            "full_kl_by_position": (by_index / counts.clamp(min=1)).tolist(), "positions": int(len(kl))}


def locate(engine, scorer, batch, temperature: float, dtype: torch.dtype) -> dict:
    """:func:`compare` of the engine's and the learner's traces over ``batch``."""
    eng = engine_trace(engine, batch, temperature)
    lrn = learner_trace(scorer, batch, temperature)
    return compare(eng, lrn, batch, dtype, op_names(scorer.model))


def arm_label(r: dict) -> str:
    q, kv = r.get("quantization", "none"), r.get("kv_cache", "auto")
    return f"{r['engine']}/{r['precision']}" + ("" if q == "none" else f"/{q}") + ("" if kv == "auto" else f"/KV {kv}")


def summary_ops(ops: list[str]) -> list[str]:
    """The ops the console table shows: the embedding, the first layer's attention and output, the middle and the
    last layer's outputs, the final norm and the head (``locate.md`` has every op)."""
    last = max(int(o[1:].split(".")[0]) for o in ops if o.startswith("L"))
    keep = ["embed", "L0.attn", "L0.scan", "L0.linear", "L0.out", f"L{last // 2}.out", f"L{last}.out", "norm", "head"]
    return list(dict.fromkeys(o for o in keep if o in ops))


def format_locate(results: list[dict]):
    """A rich Table: per arm, the first op above its rounding line, the error at a few ops and the full KL."""
    from rich.table import Table

    rows = [r for r in results if r.get("locate")]
    shown = summary_ops([o["op"] for o in rows[0]["locate"]["ops"]])
    table = Table(title="--locate: where the engine and the learner first part (relative error per op; "
                        "line = 4 unit roundoffs of the engine's dtype)")
    for name in ("arm", "line", "first above", *shown, "full KL mean", "full KL max"):
        table.add_column(name, justify="left" if name in ("arm", "first above") else "right")
    for r in rows:
        loc = r["locate"]
        err = {o["op"]: o for o in loc["ops"]}
        cells = [(f"[bold]{err[o]['rel_error']:.2g}[/]" if err[o]["above"] else f"{err[o]['rel_error']:.2g}")
                 for o in shown]
        first = loc["first_above"]
        table.add_row(loc["arm"], f"{loc['rounding_line']:.1g}",
                      f"{first} ({err[first]['rel_error']:.2g})" if first else "none", *cells,
                      f"{loc['full_kl_mean']:.3g}", f"{loc['full_kl_max']:.3g}")
    return table


def locate_markdown(results: list[dict]) -> str:
    """Every op of every arm, one row per op (``OUT/locate.md``)."""
    rows = [r for r in results if r.get("locate")]
    labels = [r["locate"]["arm"] for r in rows]
    lines = ["# Where the engine and the learner part (`unison probe --locate`)", "",
             "Relative error ‖h_engine − h_learner‖ / ‖h_learner‖ of every op over the positions that predict "
             "response tokens (bold: above the arm's rounding line, 4 unit roundoffs of the engine's dtype); "
             "the head row compares probabilities.", ""]
    lines += ["| arm | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]
    lines += ["| rounding line | " + " | ".join(f"{r['locate']['rounding_line']:.1g}" for r in rows) + " |",
              "| first op above | " + " | ".join(r["locate"]["first_above"] or "none" for r in rows) + " |",
              "| full-vocabulary KL mean / max | " + " | ".join(
                  f"{r['locate']['full_kl_mean']:.3g} / {r['locate']['full_kl_max']:.3g}" for r in rows) + " |"]
    for i, op in enumerate(o["op"] for o in rows[0]["locate"]["ops"]):
        cells = []
        for r in rows:
            o = r["locate"]["ops"][i]
            cells.append(f"**{o['rel_error']:.2e}**" if o["above"] else f"{o['rel_error']:.2e}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
