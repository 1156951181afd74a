"""Named small DiffusionGemma-architecture configs for training from scratch.

`model_config(size, vocab_size, canvas_length, context)` returns a config.json dict (model_type
diffusion_gemma) that blockpress and transformers 5.23 both load. Rules: 4 heads, 2 KV
heads, head_dim = hidden/4, global_head_dim = 2*head_dim, 1 global KV head, 4 experts top-2,
moe_intermediate = hidden, intermediate = 2*hidden, sliding_window >= context + canvas so sliding
layers behave as full attention, softcap 30.
"""

from __future__ import annotations

from ..errors import InputError

# transformers builds a default (~170M-parameter) vision tower when vision_config is null; a text-only
# model declares a tiny one instead (blockpress ignores vision; transformers initialises it randomly).
TINY_VISION = {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}

SIZES = {  # name: (hidden, layers)
    "nano": (64, 2),
    "micro": (128, 4),
    "mini": (192, 6),
    "small": (256, 8),
}


def model_config(size: str = "micro", vocab_size: int = 16, canvas_length: int = 96, context: int = 96,
                 pad_id: int = 0, eos_id: int = 1, bos_id: int = 2, experts: int = 4, top_k: int = 2) -> dict:
    if size not in SIZES:
        raise InputError(f"unknown model size {size!r}; choose one of {sorted(SIZES)} or pass a config.json")
    H, L = SIZES[size]
    hd = H // 4
    window = 1 << (context + canvas_length - 1).bit_length()  # >= context + canvas
    text = dict(
        vocab_size=vocab_size, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hd, global_head_dim=2 * hd,
        num_global_key_value_heads=1, num_experts=experts, top_k_experts=top_k, moe_intermediate_size=H,
        sliding_window=window, max_position_embeddings=max(4096, 2 * window),
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=bos_id, final_logit_softcapping=30.0,
        use_bidirectional_attention=None,
    )
    return {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "canvas_length": canvas_length, "text_config": text, "vision_config": TINY_VISION,
            "eos_token_id": [eos_id], "pad_token_id": pad_id, "bos_token_id": bos_id, "tie_word_embeddings": True}
