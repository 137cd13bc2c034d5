"""Tiny random models of many architectures, with the built-in character tokenizer.

For tests and for trying unison on an architecture before downloading it: each is
a ``save_pretrained`` directory that transformers, vLLM and unison load like any
model. ``python -m unison.zoo DIR`` writes all of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from unison.models import RECURRENT_RUN, build_char_tokenizer

_DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512)

#: model type -> config keyword arguments (vocabulary and special tokens are added)
ARCHITECTURES: dict[str, dict] = {
    "llama": dict(_DENSE),
    "mistral": dict(_DENSE, sliding_window=24),  # a window shorter than prompt + response
    "qwen2": dict(_DENSE),
    "qwen3": dict(_DENSE),
    "gemma2": dict(_DENSE, sliding_window=24, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(_DENSE, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=30.0),
    "phi3": dict(_DENSE),
    "olmo2": dict(_DENSE),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=512),
    "qwen3_moe": dict(_DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(_DENSE, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(_DENSE, num_experts=8, num_experts_per_tok=2),
    # hybrid / state-space (issue 54), contexts of 2048 (the probe's 1024-token responses): Gated DeltaNet layers 0-2
    # and gated attention in layer 3; Mamba2 blocks only; Nemotron-H: a Mamba2 mixer, an MLP, attention, an MLP (one
    # block type a layer); Falcon-H1: attention and a Mamba2 mixer side by side in every layer, chunks of 8 tokens
    "qwen3_next": dict(_DENSE, max_position_embeddings=2048, num_hidden_layers=4, num_experts=0,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16),
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                   expand=2),
    "nemotron_h": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=2048, n_routed_experts=0, ssm_state_size=16,
                       layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=1, chunk_size=8),
    "falcon_h1": dict(_DENSE, max_position_embeddings=2048, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                      mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8),
}
#: the hybrid and state-space models among them (their own recurrent decode; no packing)
RECURRENT = tuple(t for t in ARCHITECTURES if t in RECURRENT_RUN)


def build(model_type: str, out_dir: str | Path, seed: int = 0, init_std: float = 0.1, **overrides) -> Path:
    """A random ``model_type`` model (std ``init_std``: peaked outputs, as trained LMs have)
    with the character tokenizer, saved to ``out_dir``; ``overrides`` replace config keys of :data:`ARCHITECTURES`
    (e.g. a wider model for an experiment)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_char_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               initializer_range=init_std, tie_word_embeddings=False,
                               **{**ARCHITECTURES[model_type], **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":  # pragma: no cover
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "zoo")
    for name in ARCHITECTURES:
        print(build(name, root / name))
