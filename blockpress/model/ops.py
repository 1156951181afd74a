"""The functions a DiffusionGemmaModel's passes call where a faster one may stand in, as one object.

`Ops()` holds the plain PyTorch references; `kernels.select.configure` (the one place that picks kernels, from the
model's `Options`) gives the model another `Ops` with the fast paths. The model never looks a kernel up by name.

- attention(q [B,nh,S,D], k, v [B,kv,L,D], mask additive or None) -> [B,nh,S,Dv] (scaling exactly 1.0)
- softcap(logits [B,C,V], cap, out=None) -> fp32 cap * tanh(logits / cap) (into `out` when given)
- soft_embedding(sc_logits [B,C,V], E [V,H]) -> softmax(sc_logits) @ E [B,C,H] in E's dtype; None: the exact one
- block(layer, x, attend, scalar) -> a decoder block's output; None: the block's own forward (torch.compile gives
  a compiled one)
- fixed_attention(q [B,nh,S+C,D], keys, values [B,kv,R,D] a layer's cache buffers, valid [B,P], start, S, window,
  ring) -> [B,nh,S+C,D]: a fixed-shape pass's attention read from the cache in place, visibility by the rules of
  model/keys.py (kernels/attention_fixed.py); None: masks over the cache and `attention` (model/keys.py `Fixed`)
The experts' kernel is each `Experts` module's own (`Experts.kernel`; quantised experts choose theirs), and the
routing's each `Router`'s (`Router.kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .layers import attention_sdpa, softcap_logits


@dataclass(frozen=True)
class Ops:
    attention: Callable = attention_sdpa
    softcap: Callable = softcap_logits
    soft_embedding: Callable | None = None
    block: Callable | None = None
    fixed_attention: Callable | None = None
