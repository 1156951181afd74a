"""Attention fast path: SDPA with grouped-query heads handled inside the kernel.

Same function as `model.layers.attention_sdpa` (scaling exactly 1.0, additive mask), but the KV
heads are not expanded with `repeat_interleave` first: that copy re-reads and re-writes the whole
visible cache on every layer of every denoising step (groups 2 on sliding layers, 8 on full).
"""

from __future__ import annotations

import torch.nn.functional as F


def attention_sdpa_gqa(q, k, v, mask):
    """q [B,nh,S,D], k/v [B,kv,L,D], mask additive [B|1,1,S|1,L] or None."""
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=q.shape[1] != k.shape[1])
