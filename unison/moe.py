"""Mixture-of-experts routing: record which experts each token chose, replay them, compare.

In transformers 5.x the MoE families (Qwen3-MoE, Mixtral, OLMoE) route with a
``*TopKRouter`` module (``layers[i].mlp.gate``) whose forward returns
``(router_logits [N, E], weights [N, k], indices [N, k])`` for the N = batch·sequence
tokens of the call. A forward hook reads the indices (recording) or replaces the
output (replay).

* ``mismatch/router_disagreement``: the share of response tokens for which any
  MoE layer selected a different set of experts in the rollout engine than in
  the learner (routing is a discrete function of the hidden state, so a
  numerical mismatch of the activations can flip it — and then π and μ differ
  by far more than rounding).
* **Routing replay** (``moe.routing_replay``; Rollout Routing Replay, Ma et al.
  2025): the learner uses the rollout's expert indices; the combination weights
  are the learner's own router probabilities at those experts (renormalised as
  the router does), so gradients still reach the router.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router modules, in layer order (empty for a dense model)."""
    return [m for _, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


def top_k(model: torch.nn.Module) -> int:
    rs = routers(model)
    return int(rs[0].top_k) if rs else 0


@contextlib.contextmanager
def record(model: torch.nn.Module, out: list):
    """Append, for each forward of ``model`` inside the block, a tensor [N, layers, k] (int64)
    of the experts every token selected."""
    rs = routers(model)
    calls: list[list[torch.Tensor]] = []

    def hook(i):
        def fn(mod, args, output):
            if i == 0:
                calls.append([])
            calls[-1].append(output[2].detach())
        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(rs)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
        out.extend(torch.stack(c, dim=1).to("cpu", torch.int64) for c in calls if len(c) == len(rs))


@contextlib.contextmanager
def replay(model: torch.nn.Module, indices: torch.Tensor):
    """Force the experts of the next forward: ``indices`` [N, layers, k] in the flattened token
    order of that forward. The weights are this model's own probabilities at those experts,
    renormalised as the router renormalises (Mixtral always; Qwen3-MoE/OLMoE per ``norm_topk_prob``)."""
    rs = routers(model)

    def hook(i):
        def fn(mod, args, output):
            logits = output[0]
            idx = indices[:, i].to(logits.device)
            w = F.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, idx)
            if getattr(mod, "norm_topk_prob", True):
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(output[1].dtype), idx
        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(rs)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def routing_buffer(model: torch.nn.Module, shape) -> torch.Tensor:
    """A [*shape, layers, k] buffer of expert choices, -1 (unknown) until a forward fills it."""
    return torch.full((*shape, len(routers(model)), top_k(model)), -1, dtype=torch.int64)


def gather_routing(routing: torch.Tensor | None, dist) -> torch.Tensor | None:
    """Every rank's rows of a routing buffer (-1 elsewhere) on every rank (a collective when distributed)."""
    if routing is None or not dist.enabled:
        return routing
    shifted = routing + 1  # rows nobody filled stay 0, so the sum over ranks is the union
    return dist.all_reduce_(shifted, "sum") - 1


def replay_indices(routing: torch.Tensor) -> torch.Tensor:
    """The rollout's expert choices [rows, L, layers, k] as the flattened [rows·L, layers, k] a router sees;
    positions the rollout never fed (padding, the last token) get experts 0..k-1, whose outputs nothing reads."""
    r = routing.clone()
    fill = torch.arange(r.shape[-1]).expand_as(r)
    unknown = (r < 0).any(-1, keepdim=True).expand_as(r)
    r[unknown] = fill[unknown]
    return r.reshape(-1, *r.shape[2:])


def disagreement(rollout: torch.Tensor, learner: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Share of response tokens whose experts differ in any layer.

    ``rollout`` and ``learner`` are [B, L, layers, k] routings of the input positions
    (-1 where unknown); response token ``t`` is produced by input position ``t − 1``.
    Sets are compared (order of the k experts does not matter)."""
    sel = response_mask[:, 1:].bool()
    a = rollout[:, :-1][sel].sort(dim=-1).values
    b = learner[:, :-1][sel].sort(dim=-1).values
    known = (a >= 0).all(-1).all(-1) & (b >= 0).all(-1).all(-1)
    if not bool(known.any()):
        return 0.0
    differ = (a != b).any(-1).any(-1) & known
    return float(differ.sum()) / float(known.sum())
