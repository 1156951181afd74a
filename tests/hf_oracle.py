"""Test-only helpers around the transformers 5.23 reference (the oracle; never imported by blockpress).

`build_hf_model` follows spec 6.1: tiny config, eager attention and experts, eval mode, and every
constant-initialised tensor randomised (norm weights, router scales, layer scalars — encoder and
decoder independently) so that `w` vs `1 + w` or scalar bugs cannot hide.
"""

from __future__ import annotations

import torch

TINY_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "sliding_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, num_experts=8, top_k_experts=3, moe_intermediate_size=24,
    sliding_window=8, max_position_embeddings=4096,
)
TINY_VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16)


def hf_config(canvas_length=16, **text_overrides):
    from transformers import DiffusionGemmaConfig

    text = {**TINY_TEXT, **text_overrides}
    text = {k: v for k, v in text.items() if v is not None or k in ("use_bidirectional_attention",)}
    return DiffusionGemmaConfig(text_config=text, vision_config=dict(TINY_VISION), canvas_length=canvas_length)


@torch.no_grad()
def randomise_constants(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "vision" in name:
            continue
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith("router.scale") \
                or name.endswith("per_expert_scale"):
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(torch.empty(b.shape).uniform_(0.5, 1.5, generator=g))


def build_hf_model(config=None, seed=0):
    from transformers import DiffusionGemmaForBlockDiffusion

    config = config or hf_config()
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    randomise_constants(model, seed + 1)
    return model.eval()
