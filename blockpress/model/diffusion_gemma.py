"""The DiffusionGemma text stack as one plain nn.Module with two passes over shared weights.

Shape legend: B batch, S encoder chunk, C canvas length, V vocab, H hidden, L key length.

- `encode(ids, cache)`: causal pass over clean tokens (prompt, then each committed canvas) at
  positions [cache.length, cache.length + S); writes K/V into the cache; returns the final-normed
  hidden states. Uses the encoder's own `layer_scalar` buffers.
- `decode(canvas, cache, sc_logits, sc_mask)`: one bidirectional denoising pass over the canvas at
  positions [T, T + C) (T = cache.length) reading, never writing, the cache; returns fp32
  soft-capped logits [B, C, V]. Sliding layers see the last W-1 cached tokens plus the canvas.
- `encode_decode(ids, canvas, cache)`: both in one pass over the weights (a commit fused into the
  next canvas's first denoising step; opt-in in the engine, `fuse_commit=True`).
- The LM head is the (tied) embedding matrix. Parameter names mirror the checkpoint's
  `model.decoder.*` names (see weights.py), so the name map is a prefix.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from ..config import FULL, SLIDING, ModelConfig
from ..engine.cache import KVCache
from .layers import (ATTENTION_BACKENDS, MLP, SOFTCAP_BACKENDS, Attention, RMSNorm, additive_mask, embed_scale,
                     rms_norm, rope_cos_sin, rope_inv_freq, softmax_rows)
from .moe import Experts, Router

PREFILL_CHUNK = 2048  # tokens a long prompt is encoded at a time (DiffusionGemmaModel.prefill_chunk; None: whole)


class Block(nn.Module):
    def __init__(self, cfg, i: int):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.full = cfg.is_full(i)
        self.self_attn = Attention(H, cfg.num_attention_heads, cfg.layer_kv_heads(i), cfg.layer_head_dim(i),
                                   self.full, eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.router = Router(H, cfg.num_experts, cfg.top_k_experts, eps)
        self.experts = Experts(H, cfg.num_experts, cfg.moe_intermediate_size)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
                     "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(H, eps))
        self.register_buffer("layer_scalar", torch.ones(1))  # decoder pass
        self.register_buffer("encoder_layer_scalar", torch.ones(1))  # encoder pass

    def forward(self, x, attend, scalar):
        """x [B,S,H]; `attend(h) -> attention output [B,S,H]` closes over cache, mask, rope."""
        h = self.post_attention_layernorm(attend(self.input_layernorm(x)))
        x = x + h
        B, S, H = x.shape
        h1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(B * S, H)  # [N, H]; the router reads the raw residual
        w, idx = self.router(flat)
        h2 = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).view(B, S, H)
        h2 = self.post_feedforward_layernorm_2(h2)
        x = x + self.post_feedforward_layernorm(h1 + h2)
        return x * scalar


class SelfConditioning(nn.Module):
    def __init__(self, hidden: int, inter: int, eps: float):
        super().__init__()
        self.pre_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, soft):
        g = self.pre_norm(soft)
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(g), approximate="tanh") * self.up_proj(g))


class DiffusionGemmaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        cfg = self.text = config.text
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
        for t in (SLIDING, FULL):
            inv = rope_inv_freq(cfg.type_head_dim(t), cfg.rope_parameters[t])
            self.register_buffer(f"inv_freq_{t}", inv, persistent=False)
        self.attention_backend = "sdpa"
        self.softcap_backend = "torch"  # final-logit soft cap: layers.SOFTCAP_BACKENDS
        # None: the exact soft embedding softmax(z) @ E over the whole vocabulary (the reference). K: only
        # the K most likely tokens' rows of E (kernels/sc_topk.py; an approximation, opt-in)
        self.sc_topk: int | None = None
        self.window = cfg.sliding_window
        self.bidirectional_encoder = cfg.use_bidirectional_attention == "all"
        # a causal encoder's long prompt is encoded this many tokens at a time (without autograd): see `encode`
        self.prefill_chunk: int | None = PREFILL_CHUNK
        # inference caches keep a ring of the last window + `cache_reserve()` positions for the sliding layers once
        # that is smaller than the capacity (engine/cache.py); False: every position in every layer (the same numbers)
        self.ring_cache = True
        # training (blockpress.train): recompute decoder layers in backward. Encoder layers are never
        # checkpointed: they write the KV cache (spec training.md §4.3).
        self.gradient_checkpointing = False
        self._scales: dict = {}  # (dtype, device) -> sqrt(H) on that device: made once, not copied per pass
        self._rope_memo: dict = {}  # (start, length, dtype, device) -> rotary tables (see `_rope`)

    # helpers ------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / .half(): the memoised rotary tables are stale
        self._rope_memo.clear()
        return super()._apply(fn, recurse)

    def materialize_buffers(self, device) -> None:
        """Recompute the non-persistent rotary tables (after building on the meta device)."""
        self._rope_memo.clear()
        for t in (SLIDING, FULL):
            inv = rope_inv_freq(self.text.type_head_dim(t), self.text.rope_parameters[t]).to(device)
            setattr(self, f"inv_freq_{t}", inv)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init for training from scratch: normal(0, std) matrices, unit norms and scales."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.fill_(1.0)
        for name, b in self.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(1.0)
        self.materialize_buffers(self.embed_tokens.weight.device)

    def set_experts_backend(self, name: str) -> None:
        from .moe import EXPERT_BACKENDS

        if name not in EXPERT_BACKENDS:  # fast paths register themselves on import
            import blockpress.kernels  # noqa: F401
        if name not in EXPERT_BACKENDS:
            raise ValueError(f"unknown experts backend {name!r}; available: {sorted(EXPERT_BACKENDS)}")
        for layer in self.layers:
            layer.experts.backend = name

    def new_cache(self, batch: int, capacity: int, ring: bool = True) -> KVCache:
        """An empty cache for `capacity` positions. ring: the sliding layers keep only a ring of the last
        window + `cache_reserve()` positions once that is smaller than the capacity (engine/cache.py); False keeps
        every position in every layer (training: a cache cropped back to its context)."""
        return self._cache(batch, capacity, self.device, self.cache_reserve() if ring else None)

    def _cache(self, batch: int, capacity: int, device, reserve: int | None) -> KVCache:
        shapes = [(self.text.layer_kv_heads(i), self.text.layer_head_dim(i)) for i in range(len(self.layers))]
        return KVCache(shapes, batch, capacity, self.dtype, device, sliding=[not layer.full for layer in self.layers],
                       window=self.window, reserve=reserve)

    def cache_reserve(self) -> int | None:
        """The most positions one inference pass writes into the cache: a prompt chunk, or a canvas and the commit
        fused with it (`encode_decode`). None where a prompt is encoded whole (a bidirectional encoder, or
        `prefill_chunk` None): its length is unknown, so the sliding layers keep every position (also with
        `ring_cache` False)."""
        if self.bidirectional_encoder or not self.prefill_chunk or not self.ring_cache:
            return None
        return max(self.prefill_chunk, 2 * self.config.canvas_length)

    def cache_bytes(self, batch: int, capacity: int) -> int:
        """Bytes a `new_cache(batch, capacity)` holds (K/V of every layer and the padding mask), counted on the meta
        device."""
        meta = self._cache(batch, capacity, "meta", self.cache_reserve())
        return meta.nbytes() + meta.valid.numel()

    def embed_scale(self, dtype: torch.dtype, device) -> torch.Tensor:
        """sqrt(H) in `dtype` on `device`, made once: a host-to-device copy in every pass would make the
        host wait for the GPU (a copy from pageable memory synchronises the stream)."""
        key = (dtype, torch.device(device))
        scale = self._scales.get(key)
        if scale is None:
            scale = self._scales[key] = embed_scale(self.text.hidden_size, dtype).to(device)
        return scale

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return self.embed_tokens(ids) * self.embed_scale(w.dtype, w.device)

    def lm_logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of final-normed hidden states. out: an fp32 tensor of their shape to write them into (no
        autograd; the CUDA graphs' shared logits buffer).

        One product over all rows: each block of rows would read the whole [V, H] table again (1.48 GB on the 26B
        model), where splitting the rows would only save its [rows, V] model-dtype intermediate."""
        w = self.embed_tokens.weight
        cap = self.text.final_logit_softcapping
        if out is not None and torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            raise ValueError("lm_logits(out=...) writes in place and records no gradient: call it under "
                             "torch.no_grad(), or without out=")
        logits = h @ w.t()
        if out is not None:  # every soft-cap backend writes into `out` (a checked kernel's fallback too)
            return out.copy_(logits) if not cap else SOFTCAP_BACKENDS[self.softcap_backend](logits, cap, out=out)
        if not cap:
            return logits.float()
        if logits.requires_grad:
            return torch.tanh(logits.float() / cap) * cap
        return SOFTCAP_BACKENDS[self.softcap_backend](logits, cap)

    def soft_embedding(self, sc_logits: torch.Tensor) -> torch.Tensor:
        """softmax(sc_logits) @ E [B, C, H] in the weight dtype (spec 2.10's soft embedding), or its top-K
        approximation (`sc_topk`): what the eager and the static (CUDA-graph) decoder passes both call."""
        w = self.embed_tokens.weight
        if self.sc_topk is not None:
            from ..kernels.sc_topk import soft_embedding_topk

            return soft_embedding_topk(sc_logits, w, self.sc_topk)
        return softmax_rows(sc_logits, w.dtype) @ w  # softmax(z.float()).to(w.dtype), in 64 MB chunks

    def _rope(self, start: int, length: int, dtype, device) -> dict:
        """Rotary tables for positions [start, start + length), per layer type. Every denoising step of a
        canvas asks for the same span, so the last few spans are kept (a small host-side memo: the
        tables are a function of the span, dtype and device only; nothing writes to them)."""
        key = (start, length, dtype, torch.device(device))
        tables = self._rope_memo.get(key)
        if tables is None:
            pos = torch.arange(start, start + length, device=device)
            tables = {t: rope_cos_sin(getattr(self, f"inv_freq_{t}"), pos, dtype) for t in (SLIDING, FULL)}
            if len(self._rope_memo) >= 8:  # a new canvas: the old spans are done with
                self._rope_memo.clear()
            self._rope_memo[key] = tables
        return tables

    def _encoder_masks(self, T0: int, S: int, cache: KVCache, dtype, dev) -> dict:
        """Per layer type: (first visible cache position lo, additive mask [B|1,1,S,T0+S-lo]) for an
        encoder chunk at positions [T0, T0+S) (spec 3.2: causal, sliding layers q - W < k <= q)."""
        pos = torch.arange(T0, T0 + S, device=dev)
        W = self.window
        masks = {}
        for t in (SLIDING, FULL):
            if self.bidirectional_encoder:
                lo = 0 if t == FULL else max(0, T0 - W)
            else:
                lo = 0 if t == FULL else max(0, T0 - W + 1)
            kp = torch.arange(lo, T0 + S, device=dev)
            if self.bidirectional_encoder:
                allowed = torch.ones(S, kp.numel(), dtype=torch.bool, device=dev)
                if t == SLIDING:
                    allowed = (kp[None, :] - pos[:, None]).abs() <= W
            else:
                allowed = kp[None, :] <= pos[:, None]
                if t == SLIDING:
                    allowed = allowed & (kp[None, :] > pos[:, None] - W)
            allowed = allowed[None, None]  # [1,1,S,L]
            if cache.has_padding:
                allowed = allowed & cache.valid[:, None, None, lo:T0 + S]
            masks[t] = (lo, additive_mask(allowed, dtype))
        return masks

    def _decoder_masks(self, T: int, B: int, C: int, cache: KVCache, dtype, dev) -> dict:
        """Per layer type: (first visible cache position lo, additive padding mask or None) for a canvas at
        [T, T+C) (spec 3.4: every canvas query sees cache [lo, T) and the whole canvas)."""
        masks = {}
        for t, lo in ((FULL, 0), (SLIDING, max(0, T - (self.window - 1)))):
            mask = None
            if cache.has_padding:
                allowed = torch.cat([cache.valid[:, lo:T],
                                     torch.ones(B, C, dtype=torch.bool, device=dev)], dim=1)[:, None, None]
                mask = additive_mask(allowed, dtype)
            masks[t] = (lo, mask)
        return masks

    # encoder pass -------------------------------------------------------------------------------
    def encode(self, ids: torch.Tensor, cache: KVCache, pad_mask: torch.Tensor | None = None,
               hidden_states: list | None = None, inputs_embeds: torch.Tensor | None = None,
               output: bool = True) -> torch.Tensor | None:
        """ids [B,S] at positions [T0, T0+S). pad_mask [B,S] bool (True = real token). Returns the final-normed
        hidden states [B,S,H].

        output=False, where only the cache is wanted (a prompt's prefill, a commit): the last layer stops once its
        K/V are written, since its queries, attention, feed-forward half and the final norm only make the hidden
        states, and None is returned. The same cache, bit for bit; on the 26B model a 2,048-token chunk skips one of
        the five full-attention layers' attention and one layer's experts, and a long prompt's prefill holds no
        [S, H] output (0.74 GB at 128K).

        Chunked prefill: without autograd, a causal encoder encodes more than `prefill_chunk` tokens a chunk at a
        time, each chunk attending to the cache the chunks before it wrote (what a commit does). The same function
        up to fp32 summation order; what changes is the memory and the work of a long prompt's attention: masks
        of [chunk, T] instead of [S, S] (at a 32K-token prompt on the 26B model, ~8.9 GB on top of the weights and
        cache become ~0.65 GB, counted by benchmarks/peak_memory.py), and sliding layers that look at
        [chunk, window + chunk] keys instead of all S. A bidirectional encoder (every prompt token sees every
        other) is encoded whole."""
        B, S = ids.shape
        T0 = cache.length
        output = output or hidden_states is not None
        k = self.prefill_chunk
        if k and S > k and not self.bidirectional_encoder and hidden_states is None and inputs_embeds is None \
                and not torch.is_grad_enabled():
            cache.ensure_capacity(T0 + S, write=k)  # once, not chunk by chunk
            out = None  # [B, S, H], filled chunk by chunk (a list of chunks and their concatenation: twice that)
            for i in range(0, S, k):  # this method, not an installed graph's pass: a prefill asked for eagerly stays so
                h = DiffusionGemmaModel.encode(self, ids[:, i:i + k], cache,
                                               None if pad_mask is None else pad_mask[:, i:i + k], output=output)
                if h is None:
                    continue
                if out is None:
                    out = h.new_empty(B, S, h.shape[-1])
                out[:, i:i + k] = h
                del h
            return out
        cache.ensure_capacity(T0 + S, write=S)
        if pad_mask is not None:
            cache.set_padding(T0, pad_mask.to(torch.bool))
        x = self.embed(ids) if inputs_embeds is None else inputs_embeds
        dtype, dev = x.dtype, x.device
        rope = self._rope(T0, S, dtype, dev)
        attn_fn = ATTENTION_BACKENDS[self.attention_backend]
        masks = self._encoder_masks(T0, S, cache, dtype, dev)
        if hidden_states is not None:
            hidden_states.append(x)
        for i, layer in enumerate(self.layers):
            t = FULL if layer.full else SLIDING
            lo, mask = masks[t]
            cos, sin = rope[t]

            def attend(h, i=i, layer=layer, lo=lo, mask=mask, cos=cos, sin=sin):
                q, k, v = layer.self_attn.project(h, cos, sin)
                cache.write(i, k, v, T0)
                ck, cv = cache.span(i, lo, T0 + S)
                return layer.self_attn.output(attn_fn(q, ck, cv, mask))

            if not output and i == len(self.layers) - 1:  # the cache needs only this layer's K/V
                cache.write(i, *layer.self_attn.project_kv(layer.input_layernorm(x), cos, sin), T0)
                break
            x = layer(x, attend, layer.encoder_layer_scalar)
            if hidden_states is not None and i < len(self.layers) - 1:
                hidden_states.append(x)
        cache.length = T0 + S
        if not output:
            return None
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        return x

    # commit + first denoising step in one pass ----------------------------------------------------
    def encode_decode(self, ids: torch.Tensor, canvas: torch.Tensor, cache: KVCache,
                      pad_mask: torch.Tensor | None = None, sc_logits: torch.Tensor | None = None,
                      sc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`encode(ids, cache, pad_mask)` then `decode(canvas, cache, sc_logits, sc_mask)`, in one pass.

        ids [B,S] (a committed canvas) at positions [T0, T0+S), canvas [B,C] at [T0+S, T0+S+C). Rows of
        both run through every layer together, so each weight is read once for the two passes (a step
        of the 26B model is bound by reading its weights). Attention is split per segment: ids queries
        see the cache causally and write their K/V first (encoder masks), canvas queries see the
        updated cache [lo, T0+S) plus the whole canvas (decoder masks); the encoder and decoder
        `layer_scalar`s scale their own rows. Same function as the two calls up to fp32 summation
        order (the GEMMs see S+C rows instead of S and C). Returns decode's logits [B,C,V]."""
        B, S = ids.shape
        C = canvas.shape[1]
        T0 = cache.length
        T = T0 + S
        cache.ensure_capacity(T, write=S)
        scratch = not torch.is_grad_enabled() and cache.scratch_room(T0, S + C)  # the canvas's K/V too, as in decode
        if pad_mask is not None:
            cache.set_padding(T0, pad_mask.to(torch.bool))
        x = torch.cat([self.embed(ids), self.decoder_input(canvas, sc_logits, sc_mask)], dim=1)  # [B, S+C, H]
        dtype, dev = x.dtype, x.device
        rope = self._rope(T0, S + C, dtype, dev)
        attn_fn = ATTENTION_BACKENDS[self.attention_backend]
        enc_masks = self._encoder_masks(T0, S, cache, dtype, dev)
        dec_masks = self._decoder_masks(T, B, C, cache, dtype, dev)
        for i, layer in enumerate(self.layers):
            t = FULL if layer.full else SLIDING
            (lo_e, mask_e), (lo_d, mask_d) = enc_masks[t], dec_masks[t]
            cos, sin = rope[t]

            def attend(h, i=i, layer=layer, lo_e=lo_e, mask_e=mask_e, lo_d=lo_d, mask_d=mask_d, cos=cos, sin=sin):
                q, k, v = layer.self_attn.project(h, cos, sin)  # [B, heads, S+C, D]
                if scratch:
                    cache.write(i, k, v, T0)
                else:
                    cache.write(i, k[:, :, :S], v[:, :, :S], T0)
                ek, ev = cache.span(i, lo_e, T)
                out_e = attn_fn(q[:, :, :S], ek, ev, mask_e)
                if scratch:
                    out_d = attn_fn(q[:, :, S:], *cache.span(i, lo_d, T + C), mask_d)
                else:
                    dk, dv = cache.span(i, lo_d, T)
                    out_d = attn_fn(q[:, :, S:], torch.cat([dk, k[:, :, S:]], 2), torch.cat([dv, v[:, :, S:]], 2),
                                    mask_d)
                return layer.self_attn.output(torch.cat([out_e, out_d], 2))

            scalar = torch.cat([layer.encoder_layer_scalar.expand(S), layer.layer_scalar.expand(C)])[None, :, None]
            x = layer(x, attend, scalar)
        cache.length = T
        return self.lm_logits(self.norm(x[:, S:]))

    # decoder pass -------------------------------------------------------------------------------
    def decoder_input(self, canvas: torch.Tensor, sc_logits: torch.Tensor | None,
                      sc_mask: torch.Tensor | None) -> torch.Tensor:
        """post_norm(embed(canvas) + SC-MLP(pre_norm(softmax(sc_logits) @ E * sqrt(H))))."""
        e = self.embed(canvas)
        if sc_logits is not None:
            soft = self.soft_embedding(sc_logits) * self.embed_scale(e.dtype, e.device)
            if sc_mask is not None:
                soft = soft * sc_mask.to(soft.dtype)[:, None, None]
            e = e + self.self_conditioning(soft)
        return rms_norm(e, None, self.text.rms_norm_eps)

    def decode(self, canvas: torch.Tensor, cache: KVCache, sc_logits: torch.Tensor | None = None,
               sc_mask: torch.Tensor | None = None, hidden_states: list | None = None,
               return_hidden: bool = False) -> torch.Tensor:
        """canvas [B,C] -> fp32 soft-capped logits [B,C,V]. Cache positions [0, length) are read only.

        Without autograd, where the cache has room, each layer writes the canvas's K/V at [length, length + C) as
        scratch (what the static passes do; the commit overwrites it) and attends over one span of the cache: the
        same keys in the same order as concatenating the cached ones and the canvas's, which copied every layer's
        visible cache once per step (at a 32K-token context on the 26B model, its full layers' 0.67 GB)."""
        B, C = canvas.shape
        T = cache.length
        scratch = not torch.is_grad_enabled() and cache.scratch_room(T, C)
        x = self.decoder_input(canvas, sc_logits, sc_mask)
        dtype, dev = x.dtype, x.device
        rope = self._rope(T, C, dtype, dev)
        attn_fn = ATTENTION_BACKENDS[self.attention_backend]
        masks = self._decoder_masks(T, B, C, cache, dtype, dev)
        if hidden_states is not None:
            hidden_states.append(x)
        for i, layer in enumerate(self.layers):
            t = FULL if layer.full else SLIDING
            lo, mask = masks[t]
            cos, sin = rope[t]

            def attend(h, i=i, layer=layer, lo=lo, mask=mask, cos=cos, sin=sin):
                q, k, v = layer.self_attn.project(h, cos, sin)
                if scratch:
                    cache.write(i, k, v, T)
                    return layer.self_attn.output(attn_fn(q, *cache.span(i, lo, T + C), mask))
                ck, cv = cache.span(i, lo, T)
                return layer.self_attn.output(attn_fn(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2), mask))

            if self.gradient_checkpointing and torch.is_grad_enabled():  # training only; the cache is read-only here
                x = torch.utils.checkpoint.checkpoint(layer, x, attend, layer.layer_scalar, use_reentrant=False)
            else:
                x = layer(x, attend, layer.layer_scalar)
            if hidden_states is not None and i < len(self.layers) - 1:
                hidden_states.append(x)
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        if return_hidden:
            return x
        return self.lm_logits(x)
