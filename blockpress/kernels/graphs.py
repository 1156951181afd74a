"""Static-shape denoising step and a CUDA-graph wrapper around it.

Shape legend: B batch, C canvas length, V vocab, P cache capacity, T encoded tokens (cache.length).

`static_decode` computes the same function as `DiffusionGemmaModel.decode` (spec 3.4) with shapes
that never change inside a generation: attention always spans the whole cache capacity P plus the
canvas, and the visible cached keys are chosen by a mask built from a *device* tensor T
(full layers: k < T; sliding layers: T - (W-1) <= k < T; padding from cache.valid). Masked keys get
weight exactly 0, so the result equals the dynamic path up to fp32 summation order (tested on CPU).
Self-conditioning always takes a logits buffer plus a per-row mask (first step: mask False, which
makes the signal exactly 0, as with no logits). Nothing in the step copies from the host: the
embedding scale and T are device tensors made before capture.

`GraphedDecoder` (CUDA only) captures `static_decode` once per (batch, canvas, cache buffers) and
replays it for every denoising step of every canvas: T is copied into the graph's input, so the
per-canvas growth of the cache needs no re-capture (only a cache reallocation does). Experts must
use a backend without host synchronisation ("grouped" on Hopper, "triton"); install with
`GraphedDecoder(module).install()`, which routes `module.decode` through the graph.
"""

from __future__ import annotations

import torch

from ..config import FULL, SLIDING
from ..model.layers import ATTENTION_BACKENDS, rms_norm, rope_cos_sin

SYNC_FREE_EXPERTS = ("grouped", "triton", "auto")  # "auto": QuantizedExperts picking triton


def decoder_input(module, canvas, sc_logits, sc_mask, scale):
    """`module.decoder_input` with the embedding scale given as a device tensor (spec 2.10) and the
    self-conditioning mask as a tensor, so that one captured graph serves steps with and without logits."""
    w = module.embed_tokens.weight
    e = torch.nn.functional.embedding(canvas, w) * scale
    p = torch.softmax(sc_logits.float(), dim=-1).to(w.dtype)
    soft = (p @ w) * scale * sc_mask.to(w.dtype)[:, None, None]  # rows without logits: exactly 0
    return rms_norm(e + module.self_conditioning(soft), None, module.text.rms_norm_eps)


def static_decode(module, canvas, cache, T, sc_logits, sc_mask, scale=None):
    """canvas [B,C]; T 0-dim int64 device tensor; sc_logits [B,C,V]; sc_mask [B] bool -> fp32 logits.
    scale: sqrt(H) in the weight dtype on the device (computed here when not given)."""
    B, C = canvas.shape
    if scale is None:
        scale = module.embed_scale(module.dtype, canvas.device)
    x = decoder_input(module, canvas, sc_logits, sc_mask, scale)
    dtype, dev = x.dtype, x.device
    pos = T + torch.arange(C, device=dev)  # canvas positions [T, T+C)
    rope = {t: rope_cos_sin(getattr(module, f"inv_freq_{t}"), pos, dtype) for t in (SLIDING, FULL)}
    kpos = torch.arange(cache.capacity, device=dev)
    seen = (kpos < T)[None] & cache.valid  # [B, P]
    lo = {FULL: torch.zeros_like(T), SLIDING: T - (module.window - 1)}
    canvas_keys = torch.ones(B, C, dtype=torch.bool, device=dev)
    masks = {}
    for t in (SLIDING, FULL):
        allowed = torch.cat([seen & (kpos >= lo[t])[None], canvas_keys], dim=1)[:, None, None]  # [B,1,1,P+C]
        masks[t] = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, torch.finfo(dtype).min)
    attn_fn = ATTENTION_BACKENDS[module.attention_backend]
    for i, layer in enumerate(module.layers):
        t = FULL if layer.full else SLIDING
        cos, sin = rope[t]

        def attend(h, i=i, layer=layer, mask=masks[t], cos=cos, sin=sin):
            q, k, v = layer.self_attn.project(h, cos, sin)
            keys = torch.cat([cache.keys[i], k], 2)  # [B, kv, P+C, D]
            values = torch.cat([cache.values[i], v], 2)
            return layer.self_attn.output(attn_fn(q, keys, values, mask))

        x = layer(x, attend, layer.layer_scalar)
    return module.lm_logits(module.norm(x))


class _Captured:
    def __init__(self, module, canvas, cache, warmup: int):
        B, C = canvas.shape
        V, dev = module.text.vocab_size, canvas.device
        self.canvas = canvas.clone()
        self.T = torch.tensor(cache.length, dtype=torch.int64, device=dev)
        self.sc = torch.zeros(B, C, V, dtype=module.dtype, device=dev)
        self.sc_mask = torch.zeros(B, dtype=torch.bool, device=dev)
        self.buffers = cache.keys[0].data_ptr()
        scale = module.embed_scale(module.dtype, dev)
        args = (module, self.canvas, cache, self.T, self.sc, self.sc_mask, scale)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm up (allocator, cuBLAS handles, Triton autotune) off the graph
            for _ in range(warmup):
                static_decode(*args)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = static_decode(*args)


class GraphedDecoder:
    """`module.decode` replacement replaying a captured static_decode (CUDA only)."""

    def __init__(self, module, warmup: int = 2):
        if not torch.cuda.is_available() or module.device.type != "cuda":
            raise RuntimeError("GraphedDecoder needs the model on a CUDA device")
        busy = {getattr(layer.experts, "backend", "?") for layer in module.layers} - set(SYNC_FREE_EXPERTS)
        if busy:
            raise ValueError(f"experts backend(s) {sorted(busy)} synchronise with the host and cannot be captured; "
                             "call module.set_experts_backend('grouped') or 'triton' first")
        self.module, self.warmup = module, warmup
        self.captured: dict = {}
        self._eager = module.decode

    def __call__(self, canvas, cache, sc_logits=None, sc_mask=None, **kwargs):
        if kwargs:  # hidden states etc.: not captured, use the eager pass
            return self._eager(canvas, cache, sc_logits, sc_mask, **kwargs)
        key = (tuple(canvas.shape), id(cache), cache.capacity)
        g = self.captured.get(key)
        if g is None or g.buffers != cache.keys[0].data_ptr():
            with torch.no_grad():
                g = self.captured[key] = _Captured(self.module, canvas, cache, self.warmup)
        g.canvas.copy_(canvas)
        g.T.fill_(cache.length)
        if sc_logits is None:
            g.sc_mask.fill_(False)
        else:
            g.sc.copy_(sc_logits)
            if sc_mask is None:
                g.sc_mask.fill_(True)
            else:
                g.sc_mask.copy_(sc_mask)
        g.graph.replay()
        return g.out.clone()  # the graph's output buffer is overwritten by the next replay

    def install(self) -> "GraphedDecoder":
        self.module.decode = self  # instance attribute shadows the method for the engine loop
        return self

    def uninstall(self) -> None:
        if self.module.__dict__.get("decode") is self:
            del self.module.decode
        self.captured.clear()
