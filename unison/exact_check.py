"""Exact mode's two checks: the start-up self-check (:func:`self_check`: every op shape and dtype the run uses gives a
row the same bits wherever it sits in its block and however many rows share the call, else another block size or a
one-line refusal) and, should step 1 still differ, where (:func:`divergence_report`: the row, position, layer and
op)."""

from __future__ import annotations

import torch

from unison.errors import UnisonError
from unison.exact import BLOCKS, ExactOps, rms_norm
from unison.mismatch import first_difference


# ------------------------------------------------------------------ the start-up self-check
def _roll_equal(fn, x: torch.Tensor, shifts) -> bool:
    """Whether ``fn``'s rows follow its input rows when they are moved to other rows of the block."""
    y = fn(x)
    return all(torch.equal(fn(x.roll(p, 0)), y.roll(p, 0)) for p in shifts)


def _check_ops(ops: ExactOps, shapes: dict, dtype: torch.dtype, gen: torch.Generator) -> str | None:
    """None if every op gives a row the same bits wherever it sits and whatever else is in its block
    (and in calls of any size, through the block wrapper); else "op, dtype, shape"."""
    R = ops.block
    shifts = sorted({1, R // 2, R - 1} - {0})

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    name = str(dtype).removeprefix("torch.")
    for n_in, n_out, bias in shapes["linear"]:
        w, x = rnd(n_out, n_in) * n_in ** -0.5, rnd(9 * R + 5, n_in)  # ten blocks in one call
        b = rnd(n_out) if bias else None
        whole = ops.linear(x, w, b)
        if not _roll_equal(lambda t, w=w, b=b: ops.linear(t, w, b), x[:R], shifts) or \
                not torch.equal(ops.linear(x[R + 3:R + 4], w, b), whole[R + 3:R + 4]) or \
                not torch.equal(ops.linear(x[:7], w, b), whole[:7]):
            return f"matmul{' with bias' if bias else ''}, {name}, [{R}, {n_in}] x [{n_in}, {n_out}]"
    for H in shapes["rms_norm"]:
        g = rnd(H)
        if not _roll_equal(lambda t, g=g: rms_norm(t, g, 1e-6), rnd(R, H), shifts):
            return f"RMSNorm, {name}, [{R}, {H}]"
    if shapes["attention"] is not None and (problem := _check_attention(ops, shapes["attention"], rnd, gen, name)):
        return problem
    H, V = shapes["log-softmax"]
    Rh = ops.head_block
    head, h = rnd(V, H) * H ** -0.5, rnd(Rh + 3, H)
    t = torch.randint(0, V, (Rh + 3,), generator=gen)
    lp = ops.logp(h, head, t, 1.0)
    engine = ops.token_logp(ops.logits(h[Rh:Rh + 1], head), t[Rh:Rh + 1], 1.0)  # the engine's one-row decode
    if not torch.equal(engine, lp[Rh:Rh + 1]) or not all(
            torch.equal(ops.logp(h[:Rh].roll(p, 0), head, t[:Rh].roll(p, 0), 1.0), lp[:Rh].roll(p, 0))
            for p in sorted({1, Rh // 2, Rh - 1} - {0})):
        return f"output layer and log-softmax, {name}, [{Rh}, {H}] x [{H}, {V}]"
    return None


def _check_attention(ops: ExactOps, shape, rnd, gen, name: str) -> str | None:
    nh, nkv, hd, K = shape
    Ra = ops.attn_block
    q, k, v = rnd(3, nh, 2 * Ra + 1, hd), rnd(3, nkv, K, hd), rnd(3, nkv, K, hd)
    allowed = torch.rand(3, 2 * Ra + 1, K, generator=gen) > 0.3
    allowed[..., 0] = True
    full = ops.attend(q, k, v, allowed, hd ** -0.5)  # three sequences in one call
    for i, j in ((1, 0), (1, 1), (0, Ra), (2, 2 * Ra)):  # one row of one sequence alone
        one = ops.attend(q[i:i + 1, :, j:j + 1], k[i:i + 1], v[i:i + 1], allowed[i:i + 1, j:j + 1], hd ** -0.5)
        if not torch.equal(one, full[i:i + 1, :, j:j + 1]):
            return (f"attention (scores, softmax, values), {name}, [{nh // nkv * Ra}, {hd}] x [{hd}, {K}] "
                    f"per key head")
    return None


def self_check(fwd, dtypes, cache_len: int) -> ExactOps:
    """Choose the block sizes this machine gives the invariance for, for every op shape and dtype the
    run uses; refuse in one line if none does. About a second for a 135M model (rows at several
    positions of a block, calls of 1, 7 and 9·block + 5 rows, one sequence's attention alone and
    among others)."""
    failures = []
    for blocks in BLOCKS:
        ops = ExactOps(*blocks)
        gen = torch.Generator().manual_seed(0)
        problem = next((p for p in (_check_ops(ops, fwd.shapes(cache_len), dt, gen) for dt in dtypes) if p), None)
        if problem is None:
            fwd.ops = ops
            return ops
        failures.append(problem)
    raise UnisonError(f"exact mode cannot hold on this CPU: {failures[0]} gives a row different bits depending on "
                      f"where it sits in the call (also with blocks of {', '.join(str(b[0]) for b in BLOCKS[1:])}); "
                      f"set exact=false (and please report the CPU: `lscpu`)")


# ------------------------------------------------------------------ when step 1 still differs
def divergence_report(learner, engine, batch, rows, logp_pi) -> str:
    """Where exact mode's two sides first differ: the row and position, and — replaying that row
    alone through the engine's decode and the learner's forward — the first layer and op whose
    outputs differ."""
    where = first_difference(logp_pi[rows], batch.logp_mu[rows], batch.response_mask[rows]) or "nowhere"
    try:
        op = _first_divergent_op(learner, engine, batch, int(rows[(logp_pi[rows] != batch.logp_mu[rows])
                                                                   .logical_and(batch.response_mask[rows].bool())
                                                                   .any(-1).nonzero()[0, 0]]))
    except Exception as e:  # noqa: BLE001 - the report must not hide the error it reports
        op = f"the replay failed ({type(e).__name__})"
    return f"{where}; {op}"


def _first_divergent_op(learner, engine, batch, row: int) -> str:
    """Replay one row through both sides' code with the engine's weights (the learner's θ_old casts
    are exactly those; after the update the learner's own have moved on)."""
    fwd_l, fwd_e = learner.exact, engine.exact
    w_e = fwd_e.weights(engine.dtype)
    w_l = w_e
    tokens, key_ok = batch.tokens[row:row + 1], batch.attention_mask[row:row + 1].bool()
    K = tokens.shape[1]
    pos = (key_ok.long().cumsum(-1) - 1).clamp(min=0)
    lt: dict = {}
    with torch.no_grad():
        fwd_l.hidden(w_l, tokens, pos, key_ok, trace=lt)
        P = engine.prompt_width or int(batch.prompt_lens[row])
        cache = fwd_e.new_cache(1, K, engine.dtype, tokens.device)
        ok = torch.zeros(1, K, dtype=torch.bool)
        ok[:, :P] = key_ok[:, :P]
        et: dict = {}
        fwd_e.hidden(w_e, tokens[:, :P], pos[:, :P], ok, cache, 0, trace=et)
        found = _compare(lt, et, slice(0, P))
        if found:
            return f"replayed alone, {found} first differs (prefill)"
        for c in range(P, K - 1):
            if not bool(key_ok[0, c]):
                break
            ok[:, c] = True
            et = {}
            fwd_e.hidden(w_e, tokens[:, c:c + 1], pos[:, c:c + 1], ok, cache, c, trace=et)
            found = _compare(lt, et, slice(c, c + 1))
            if found:
                return f"replayed alone, {found} first differs at position {c}"
    return ("replayed alone the row agrees in every op: the weights differed (a sync that did not take) or the "
            "other rows of the batch mattered")


def _compare(full: dict, step: dict, cols: slice) -> str | None:
    for key in step:  # in the order the forward ran them
        a, b = full[key], step[key]
        a = a[:, :, cols] if key[1] == "attention" else a[:, cols]
        if not torch.equal(a, b):
            layer, op = key
            return f"layer {layer} {op}" if op != "final norm" else "the final norm"
    return None
