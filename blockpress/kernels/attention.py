"""Attention fast path: torch SDPA, reaching its fused kernels for grouped-query attention.

Same function as `model.layers.attention_sdpa` / `attention_eager` (scaling exactly 1.0, additive mask), without
their `repeat_interleave` of the keys and values (a copy of the whole visible cache per layer and pass). The 26B
model has 2 query heads per KV head on its sliding layers (head dim 256) and 8 on its full layers (head dim 512).
Two ways to give SDPA grouped heads:
- `enable_gqa=True`: FlashAttention reads each KV head once for its group. But only flash takes it, and flash takes
  no mask and head dims up to 256: given a mask, or the full layers' 512 dims, SDPA falls back (silently) to its
  math kernel, which holds the [B, heads, S, L] fp32 scores (a 2,048-token prefill chunk at a 128K-token context:
  17 GB for one full layer; a denoising step's full layer at 128K: 2.1 GB).
- the query heads of each KV head folded into the query length (q [B, kv, groups x S, D]): plain multi-head
  attention over the KV heads as they are, which the memory-efficient kernel takes with a mask and any head dim.
  Rows are independent, so it is the same function. A mask with a row per query (an encoder pass's) must then be
  repeated per group; where that copy would pass `MASK_REPEAT_BYTES` (long contexts), the groups go one call each
  instead (query heads j, g + j, ...: one per KV head), with the mask as it is.
`attention_sdpa_gqa` takes flash's GQA where flash can run (no mask, head dim <= 256), folds elsewhere. A folded
call's output is unfolded by `reshape`, not `view`: CUDA's flash and memory-efficient kernels return [B, kv, g x S,
Dv] as a transposed view of a [B, g x S, kv, Dv] buffer (CPU's are contiguous; read from PyTorch's source, not yet
seen on a GPU), which no view can split back into
[B, H, S, Dv]; the copy is the output's size, which the output projection's transpose copies anyway.
"""

from __future__ import annotations

import torch.nn.functional as F

FLASH_MAX_HEAD_DIM = 256  # FlashAttention's largest head dim (the only SDPA kernel that takes enable_gqa)
MASK_REPEAT_BYTES = 1 << 28  # the largest per-group copy of a mask made to fold the groups into one call


def attention_sdpa_gqa(q, k, v, mask, sdpa=F.scaled_dot_product_attention):
    """q [B,nh,S,D], k/v [B,kv,L,D], mask additive [B|1,1,S|1,L] or None -> [B,nh,S,Dv]. sdpa: the kernel
    (`kernels.memory` passes a stand-in that allocates only its output)."""
    B, H, S, D = q.shape
    kv = k.shape[1]
    g = H // kv
    if mask is not None:
        mask = mask.to(q.dtype)
    if g == 1:
        return sdpa(q, k, v, attn_mask=mask, scale=1.0)
    if mask is None and D <= FLASH_MAX_HEAD_DIM:
        return sdpa(q, k, v, scale=1.0, enable_gqa=True)
    Dv = v.shape[-1]
    # query head i * g + j reads KV head i: once folded, rows [j * S, (j + 1) * S) of KV head i
    if mask is None or mask.shape[-2] == 1:  # no mask, or one row for every query (a decoder pass's padding)
        return sdpa(q.reshape(B, kv, g * S, D), k, v, attn_mask=mask, scale=1.0).reshape(B, H, S, Dv)
    if g * mask.numel() * mask.element_size() <= MASK_REPEAT_BYTES:
        out = sdpa(q.reshape(B, kv, g * S, D), k, v, attn_mask=mask.repeat(1, 1, g, 1), scale=1.0)
        return out.reshape(B, H, S, Dv)
    out = q.new_empty(B, kv, g, S, Dv)
    for j in range(g):  # one query head per KV head a call: the mask as it is
        out[:, :, j] = sdpa(q[:, j::g], k, v, attn_mask=mask, scale=1.0)
    return out.view(B, H, S, Dv)
