"""Model sizes the benchmarks build with random weights, and the dtypes they take (no torch import: the CLI lists
them in its help)."""

from __future__ import annotations

PRESETS = {
    # the reference's tiny test model: CI-sized, runs in seconds on a CPU
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, num_experts=8,
                  top_k_experts=3, moe_intermediate_size=32, sliding_window=8, max_position_embeddings=4096,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                               "sliding_attention", "full_attention"]), 16, 32, 32),
    # every structural feature of the real model at ~1/100 of its width (~30M parameters)
    "small": (dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, global_head_dim=128, num_global_key_value_heads=1,
                   num_experts=32, top_k_experts=4, moe_intermediate_size=128, sliding_window=128,
                   max_position_embeddings=8192), 64, 128, 128),
    # google/diffusiongemma-26B-A4B-it text stack
    "real-26b": (dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                      num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
                      global_head_dim=512, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                      max_position_embeddings=262144, sliding_window=1024, rms_norm_eps=1e-6,
                      final_logit_softcapping=30.0, use_bidirectional_attention="vision",
                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5), 256, 1024, 1024),
}


def preset_config(name: str) -> tuple[dict, int, int]:
    """-> config.json dict, default prompt tokens, default new tokens."""
    text, canvas, prompt, new = PRESETS[name]
    return {"model_type": "diffusion_gemma", "text_config": dict(text), "canvas_length": canvas}, prompt, new
