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
from .cache import KVCache
from .keys import Fixed, Spans
from .layers import MLP, Attention, RMSNorm, embed_scale, rms_norm, rope_cos_sin, rope_inv_freq, softmax_rows
from .moe import Experts, Router
from .ops import Ops

PREFILL_CHUNK = 2048  # tokens a long prompt is encoded at a time (DiffusionGemmaModel.prefill_chunk; None: whole)
LM_HEAD_PART_BYTES = 1 << 24  # lm_logits into a buffer: the product in vocabulary slices of about this many bytes,
LM_HEAD_PARTS = 8  # and at most this many (each slice is a GEMM and a soft-cap launch)


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

    def forward(self, x, attend, scalar, checkpoint_ffn: bool = False, normed=None, then=None):
        """x [B,S,H]; `attend(h) -> attention output [B,S,H]` closes over cache, mask, rope. checkpoint_ffn (training):
        recompute the feed-forward half in backward instead of keeping its activations (the attention half writes
        the K/V cache, so it is not recomputed). normed: `input_layernorm(x)` where the caller has it; then: the norm
        that follows this block (the next layer's input norm, or the final norm), applied to the output and returned
        beside it, (out, then(out)): a compiled block computes it in its last kernel (see `_layers`)."""
        h = self.post_attention_layernorm(attend(self.input_layernorm(x) if normed is None else normed))
        x = x + h
        if checkpoint_ffn:
            return torch.utils.checkpoint.checkpoint(self.feed_forward, x, use_reentrant=False) * scalar
        out = self.feed_forward(x) * scalar
        return out if then is None else (out, then(out))

    def feed_forward(self, x):
        """The dense MLP and the experts side by side, on the residual after attention."""
        B, S, H = x.shape
        h1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        flat = x.reshape(B * S, H)  # [N, H]; the router reads the raw residual
        w, idx = self.router(flat)
        h2 = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).view(B, S, H)
        h2 = self.post_feedforward_layernorm_2(h2)
        return x + self.post_feedforward_layernorm(h1 + h2)


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
        # built on the meta device (loading: every tensor is assigned after), the embedding's random init is skipped:
        # a normal_ on meta imports torch._dynamo, ~1 s of every command's start
        shape = (cfg.vocab_size, cfg.hidden_size)
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if meta else None)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
        for t in (SLIDING, FULL):
            inv = rope_inv_freq(cfg.type_head_dim(t), cfg.rope_parameters[t])
            self.register_buffer(f"inv_freq_{t}", inv, persistent=False)
        self.ops = Ops()  # attention, soft cap, self-conditioning embedding, block: the references (model/ops.py)
        self.window = cfg.sliding_window
        self.bidirectional_encoder = cfg.use_bidirectional_attention == "all"
        # a causal encoder's long prompt is encoded this many tokens at a time (without autograd): see `encode`
        self.prefill_chunk: int | None = PREFILL_CHUNK
        # inference caches keep a ring of the last window + `cache_reserve()` positions for the sliding layers once
        # that is smaller than the capacity (model/cache.py); False: every position in every layer (the same numbers)
        self.ring_cache = True
        # training (blockpress.train): recompute decoder layers in backward, and the encoder layers' feed-forward
        # halves (their attention halves write the K/V cache, so they are kept).
        self.gradient_checkpointing = False
        self._scales: dict = {}  # (dtype, device) -> sqrt(H) on that device: made once, not copied per pass
        self._rope_memo: dict = {}  # (start, length, dtype, device) -> rotary tables (see `_rope`)

    # helpers ------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        table = self.quantized_table
        return self.embed_tokens.weight.dtype if table is None else table.dtype

    @property
    def device(self) -> torch.device:
        table = self.quantized_table
        return self.embed_tokens.weight.device if table is None else table.weight_q.device

    @property
    def quantized_table(self):
        """The embedding table when it is held in 8 bits (kernels/linear_q.py `QuantizedEmbedding`: the lookup, the
        LM head and the soft embedding are its methods), else None (an nn.Embedding, used here directly)."""
        return None if isinstance(self.embed_tokens, nn.Embedding) else self.embed_tokens

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / .half(): the memoised rotary tables are stale
        self._rope_memo.clear()
        out = super()._apply(fn, recurse)
        inv = getattr(self, f"inv_freq_{SLIDING}")
        if inv.dtype != torch.float32:  # a cast: the rotary frequencies stay fp32 (as built and loaded), computed again
            self.materialize_buffers(inv.device)
        return out

    def materialize_buffers(self, device) -> None:
        """Recompute the non-persistent rotary tables (after building on the meta device)."""
        self._rope_memo.clear()
        for t in (SLIDING, FULL):
            inv = rope_inv_freq(self.text.type_head_dim(t), self.text.rope_parameters[t]).to(device)
            setattr(self, f"inv_freq_{t}", inv)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, scaled_qk: bool = False) -> None:
        """Random init for training from scratch: normal(0, std) matrices, unit norms and scales, except the
        query and key norms' scales: D^-1/4 each. Attention here is unscaled (q.k, not q.k/sqrt(D)), and with
        unit scales the RMS-normalised q and k give scores of spread ~sqrt(D) at the start, a near one-hot
        attention to random keys that learns slowly; D^-1/4 on both gives the usual q.k/sqrt(D) at the start and
        leaves the scales free to grow (the micro chat model: 2.4x the held-out sums right after 1,000 steps).
        scaled_qk False keeps unit scales there too (the random-weight models of tests and benchmarks)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif scaled_qk and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(p.numel() ** -0.25)
            else:
                p.fill_(1.0)
        for name, b in self.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(1.0)
        self.materialize_buffers(self.embed_tokens.weight.device)

    def new_cache(self, batch: int, capacity: int, ring: bool = True) -> KVCache:
        """An empty cache for `capacity` positions. ring: the sliding layers keep only a ring of the last
        window + `cache_reserve()` positions once that is smaller than the capacity (model/cache.py); False keeps
        every position in every layer (training: a cache cropped back to its context)."""
        return self._cache(batch, capacity, self.device, self.cache_reserve() if ring else None)

    def cache_mismatch(self, cache: KVCache) -> str | None:
        """What makes `cache` not this model's layout (layers, K/V heads and head dims, sliding layers and window,
        dtype, device), in words; None when it fits. A cache of another model with the same layout fits."""
        shapes = self._cache_shapes()
        held = [(k.shape[1], k.shape[3]) for k in cache.keys]
        if len(held) != len(shapes):
            return f"{len(held)} layers, the model has {len(shapes)}"
        if held != shapes:
            i = next(i for i, (a, b) in enumerate(zip(held, shapes)) if a != b)
            return f"layer {i} holds {held[i][0]} K/V heads of {held[i][1]}, the model's has {shapes[i][0]} of " \
                   f"{shapes[i][1]}"
        sliding = [not layer.full for layer in self.layers]
        if list(cache.sliding) != sliding or (any(sliding) and cache.window != self.window):
            return "its sliding-window layers are not the model's"
        if cache.keys and (cache.keys[0].dtype != self.dtype or cache.keys[0].device != self.device):
            return f"{cache.keys[0].dtype} on {cache.keys[0].device}, the model is {self.dtype} on {self.device}"
        return None

    def _cache_shapes(self) -> list[tuple[int, int]]:
        """(K/V heads, head dim) of each layer's cache."""
        return [(self.text.layer_kv_heads(i), self.text.layer_head_dim(i)) for i in range(len(self.layers))]

    def _cache(self, batch: int, capacity: int, device, reserve: int | None) -> KVCache:
        return KVCache(self._cache_shapes(), batch, capacity, self.dtype, device,
                       sliding=[not layer.full for layer in self.layers], window=self.window, reserve=reserve)

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
        return self.embed_tokens(ids) * self.embed_scale(self.dtype, self.device)

    def lm_logits(self, h: torch.Tensor, out: torch.Tensor | None = None, capped: bool = True) -> torch.Tensor:
        """fp32 logits of final-normed hidden states. out: an fp32 tensor of their shape to write them into (no
        autograd; the CUDA graphs' shared logits buffer).

        capped=False: the LM head's product in the weight dtype, before the soft cap, for a caller that applies the
        cap itself (the fast sampler, in its one pass over the vocabulary: the fp32 logits are never written); out
        is then a weight-dtype tensor, written by one product.

        One product over all rows: each block of rows would read the whole [V, H] table again (1.48 GB on the 26B
        model). Into `out`, a product larger than `LM_HEAD_PART_BYTES` runs over the vocabulary in up to
        `LM_HEAD_PARTS` slices instead, each soft-capped into its columns of `out`: the table is still read once, and
        the model-dtype intermediate is a slice's (17 MB on the 26B model at batch 1, not 134 MB: the CUDA graphs'
        memory pool peaks there). Each logit is the same dot product either way (bit for bit on a CPU, tested).
        An int8 table (`quantized_table`) computes each product in its int8 linear kernel (`head`), whole or by slice
        the same way, a capped=False product into `out` by a copy."""
        table = self.quantized_table
        w = self.embed_tokens.weight if table is None else None
        if table is not None and torch.is_grad_enabled() and h.requires_grad:  # (training: differentiable in h)
            w, table = table.dequantize(h.dtype), None
        cap = self.text.final_logit_softcapping
        if out is not None and torch.is_grad_enabled() and (h.requires_grad or (w is not None and w.requires_grad)):
            raise ValueError("lm_logits(out=...) writes in place and records no gradient: call it under "
                             "torch.no_grad(), or without out=")

        def head(rows=slice(None)):  # h @ table[rows]^T in the activation dtype (8-bit: the int8 linear kernel)
            return h @ w[rows].t() if table is None else table.head(h, rows)

        V, rows = self.text.vocab_size, h.numel() // h.shape[-1]
        if not capped:
            if out is None:
                return head()
            if table is None:
                torch.mm(h.reshape(-1, h.shape[-1]), w.t(), out=out.view(-1, V))
                return out
        parts = min(LM_HEAD_PARTS, -(-rows * V * h.element_size() // LM_HEAD_PART_BYTES))  # ceil
        if out is not None and parts > 1:
            step = -(-V // parts)
            for v0 in range(0, V, step):
                part, dst = head(slice(v0, v0 + step)), out[..., v0:v0 + step]
                if cap and capped:
                    self.ops.softcap(part, cap, out=dst)
                else:
                    dst.copy_(part)
            return out
        logits = head()
        if out is not None:  # every soft-cap kernel writes into `out` (a checked kernel's fallback too)
            return out.copy_(logits) if not (cap and capped) else self.ops.softcap(logits, cap, out=out)
        if not cap:
            return logits.float()
        if logits.requires_grad:
            return torch.tanh(logits.float() / cap) * cap
        return self.ops.softcap(logits, cap)

    def soft_embedding(self, sc_logits: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(sc_logits) @ E [B, C, H] in the weight dtype (the soft embedding), or what `ops` puts
        in its place (the top-K approximation, `sc_topk`). scratch: a contiguous buffer of at least the
        probabilities' bytes that is free until this returns (the pass's own logits buffer, written only at its
        end): they are written there instead of a new [B, C, V] tensor (134 MB on the 26B model), the same numbers."""
        table = self.quantized_table
        if self.ops.soft_embedding is not None:  # (float tables only: Options refuses sc_topk with int8 embeddings)
            return self.ops.soft_embedding(sc_logits, self.embed_tokens.weight)
        dtype, size = self.dtype, self.dtype.itemsize
        probs = None
        if scratch is not None and not torch.is_grad_enabled() and scratch.is_contiguous() \
                and scratch.numel() * scratch.element_size() >= sc_logits.numel() * size \
                and not torch._C._is_alias_of(scratch, sc_logits):  # not the input (a storage check; meta too)
            probs = scratch.view(-1).view(torch.uint8)[:sc_logits.numel() * size].view(dtype)
            probs = probs.view(sc_logits.shape)
        probs = softmax_rows(sc_logits, dtype, out=probs)  # softmax(z.float()).to(dtype), in 64 MB chunks
        return probs @ self.embed_tokens.weight if table is None else table.soft(probs)

    def _rope(self, start, length: int, dtype, device) -> dict:
        """Rotary tables for positions [start, start + length), per layer type. `start` a host int: every denoising
        step of a canvas asks for the same span, so the last few spans are kept (a small host-side memo: the tables
        are a function of the span, dtype and device only; nothing writes to them). A device tensor (the
        fixed-shape passes): computed from it, the same numbers."""
        if isinstance(start, torch.Tensor):
            pos = start + torch.arange(length, device=start.device)
            return {t: rope_cos_sin(getattr(self, f"inv_freq_{t}"), pos, dtype) for t in (SLIDING, FULL)}
        key = (start, length, dtype, torch.device(device))
        tables = self._rope_memo.get(key)
        if tables is None:
            pos = torch.arange(start, start + length, device=device)
            tables = {t: rope_cos_sin(getattr(self, f"inv_freq_{t}"), pos, dtype) for t in (SLIDING, FULL)}
            if len(self._rope_memo) >= 8:  # a new canvas: the old spans are done with
                self._rope_memo.clear()
            self._rope_memo[key] = tables
        return tables

    def _layers(self, x, rope: dict, keys, scalar, upto: int | None = None, hidden_states: list | None = None,
                checkpoint: bool = False, checkpoint_ffn: bool = False, then=None):
        """The decoder layers [0, upto) (default all) over x [B, n, H]. keys: the pass's `KeyAccess` (where it
        writes K/V, what each query sees); scalar(layer) -> the residual scale of its rows. checkpoint: recompute
        whole layers in backward (a pass that writes no cache); checkpoint_ffn: their feed-forward halves only.
        then: the norm the caller applies to the output (the final norm, or layer `upto`'s input norm): returns
        (x, then(x)) instead of x.

        Compiled blocks (the fixed-shape passes) carry each norm between blocks: the first layer's input norm runs
        before the loop, and each block computes the next one's input norm (the last block: `then`) in its last
        kernel, where the residual it normalises is made, instead of a kernel of its own at the start of the next
        block (30 kernels fewer a pass on the 26B model). Every block then takes the same arguments, so the graphs
        stay one per kind of layer. The same norms of the same tensors: eager passes compute them where they did."""
        # compiled blocks run the fixed-shape passes only: a span pass's host-position attention breaks each block
        # into pieces, each shape (every prompt length) compiles again, and it bought nothing on an H100 (a 1,024-token
        # prefill took 68 ms compiled, 71 eager; benchmarks/results/2026-11-26-h100-compiled.md)
        attn_fn, block = self.ops.attention, self.ops.block if keys.fixed else None
        layers = self.layers[:upto]
        carry = block is not None and then is not None and not (checkpoint or checkpoint_ffn)
        normed = layers[0].input_layernorm(x) if carry and len(layers) else None
        for i, layer in enumerate(layers):
            t = FULL if layer.full else SLIDING
            cos, sin = rope[t]

            def attend(h, kv=keys.layer(i), t=t, layer=layer, cos=cos, sin=sin):
                q, k, v = layer.self_attn.project(h, cos, sin)
                return layer.self_attn.output(keys.attend(kv, t, q, k, v, attn_fn))

            if checkpoint:  # training only; the cache is read-only here
                x = torch.utils.checkpoint.checkpoint(layer, x, attend, scalar(layer), use_reentrant=False)
            elif checkpoint_ffn:  # training only
                x = layer(x, attend, scalar(layer), checkpoint_ffn=True)
            elif carry:  # a compiled block (the same function), handed its input norm, making the next one's
                x, normed = block(layer, x, attend, scalar(layer), normed=normed,
                                  then=layers[i + 1].input_layernorm if i + 1 < len(layers) else then)
            elif block is not None:
                x = block(layer, x, attend, scalar(layer))
            else:
                x = layer(x, attend, scalar(layer))
            if hidden_states is not None and i < len(self.layers) - 1:
                hidden_states.append(x)
        if then is None:
            return x
        return x, normed if normed is not None else then(x)

    # encoder pass -------------------------------------------------------------------------------
    def encode(self, ids: torch.Tensor, cache: KVCache, pad_mask: torch.Tensor | None = None,
               hidden_states: list | None = None, inputs_embeds: torch.Tensor | None = None,
               output: bool = True, start: torch.Tensor | None = None) -> torch.Tensor | None:
        """ids [B,S] at positions [T0, T0+S) (T0 = cache.length). pad_mask [B,S] bool (True = real token). Returns the
        final-normed hidden states [B,S,H].

        output=False, where only the cache is wanted (a prompt's prefill, a commit): the last layer stops once its
        K/V are written, since its queries, attention, feed-forward half and the final norm only make the hidden
        states, and None is returned. The same cache, bit for bit; on the 26B model a 2,048-token chunk skips one of
        the five full-attention layers' attention and one layer's experts, and a long prompt's prefill holds no
        [S, H] output (0.74 GB at 128K).

        start: T0 as a 0-dim int64 device tensor: the fixed-shape pass (model/keys.py `Fixed`; what CUDA graphs
        capture). It reads and writes device buffers only: the caller keeps the cache's host bookkeeping (the
        capacity for T0 + S, `note_write`, `length`). No padding, hidden states or embeddings there.

        Chunked prefill: without autograd, a causal encoder encodes more than `prefill_chunk` tokens a chunk at a
        time, each chunk attending to the cache the chunks before it wrote (what a commit does). The same function
        up to fp32 summation order; what changes is the memory and the work of a long prompt's attention: masks
        of [chunk, T] instead of [S, S] (at a 32K-token prompt on the 26B model, ~8.9 GB on top of the weights and
        cache become ~0.65 GB, counted by benchmarks/peak_memory.py), and sliding layers that look at
        [chunk, window + chunk] keys instead of all S. A bidirectional encoder (every prompt token sees every
        other) is encoded whole."""
        B, S = ids.shape
        output = output or hidden_states is not None
        if start is None:
            T0 = cache.length
            k = self.prefill_chunk
            if k and S > k and not self.bidirectional_encoder and hidden_states is None and inputs_embeds is None \
                    and not torch.is_grad_enabled():
                return self._encode_chunks(ids, cache, pad_mask, output, k)
            cache.ensure_capacity(T0 + S, write=S)
            if pad_mask is not None:
                cache.set_padding(T0, pad_mask.to(torch.bool))
        x = self.embed(ids) if inputs_embeds is None else inputs_embeds
        rope = self._rope(T0 if start is None else start, S, x.dtype, x.device)
        keys = Spans(self, cache, T0, S, 0, False, x.dtype) if start is None else \
            Fixed(self, cache, start, S, 0, x.dtype)
        if hidden_states is not None:
            hidden_states.append(x)
        last = len(self.layers) - 1
        x, normed = self._layers(x, rope, keys, lambda layer: layer.encoder_layer_scalar,
                                 upto=None if output else last, hidden_states=hidden_states,
                                 checkpoint_ffn=self.gradient_checkpointing and torch.is_grad_enabled(),
                                 then=self.norm if output else self.layers[last].input_layernorm)
        if not output:  # the cache needs only the last layer's K/V
            layer = self.layers[last]
            t = FULL if layer.full else SLIDING
            keys.write(keys.layer(last), t, *layer.self_attn.project_kv(normed, *rope[t]))
        if start is None:
            cache.length = T0 + S
        if not output:
            return None
        x = normed
        if hidden_states is not None:
            hidden_states.append(x)
        return x

    def _encode_chunks(self, ids, cache, pad_mask, output: bool, k: int):
        """`encode` of a long prompt, `k` tokens at a time."""
        B, S = ids.shape
        cache.ensure_capacity(cache.length + S, write=k)  # once, not chunk by chunk
        out = None  # [B, S, H], filled chunk by chunk (a list of chunks and their concatenation: twice that)
        for i in range(0, S, k):
            h = self.encode(ids[:, i:i + k], cache, None if pad_mask is None else pad_mask[:, i:i + k], output=output)
            if h is None:
                continue
            if out is None:
                out = h.new_empty(B, S, h.shape[-1])
            out[:, i:i + k] = h
            del h
        return out

    # commit + first denoising step in one pass ----------------------------------------------------
    def encode_decode(self, ids: torch.Tensor, canvas: torch.Tensor, cache: KVCache,
                      pad_mask: torch.Tensor | None = None, sc_logits: torch.Tensor | None = None,
                      sc_mask: torch.Tensor | None = None, start: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, capped: bool = True) -> torch.Tensor:
        """`encode(ids, cache, pad_mask)` then `decode(canvas, cache, sc_logits, sc_mask)`, in one pass.

        ids [B,S] (a committed canvas) at positions [T0, T0+S), canvas [B,C] at [T0+S, T0+S+C). Rows of
        both run through every layer together, so each weight is read once for the two passes (a step
        of the 26B model is bound by reading its weights). Attention is split per segment: ids queries
        see the cache causally and write their K/V first (encoder rule), canvas queries see the
        updated cache plus the whole canvas (decoder rule); the encoder and decoder `layer_scalar`s scale their own
        rows. Same function as the two calls up to fp32 summation order (the GEMMs see S+C rows instead of S and C).
        Returns decode's logits [B,C,V] (into `out`, an fp32 tensor of their shape, when given; capped: see
        `lm_logits`). start: T0 on the device, the fixed-shape pass (see `encode`)."""
        B, S = ids.shape
        C = canvas.shape[1]
        if start is None:
            T0 = cache.length
            cache.ensure_capacity(T0 + S, write=S)
            scratch = not torch.is_grad_enabled() and cache.scratch_room(T0, S + C)  # the canvas's K/V too
            if pad_mask is not None:
                cache.set_padding(T0, pad_mask.to(torch.bool))
        x = torch.cat([self.embed(ids), self.decoder_input(canvas, sc_logits, sc_mask, out)], dim=1)  # [B, S+C, H]
        rope = self._rope(T0 if start is None else start, S + C, x.dtype, x.device)
        keys = Spans(self, cache, T0, S, C, scratch, x.dtype) if start is None else \
            Fixed(self, cache, start, S, C, x.dtype)

        def scalar(layer):  # the encoder's scale on the chunk's rows, the decoder's on the canvas's
            return torch.cat([layer.encoder_layer_scalar.expand(S), layer.layer_scalar.expand(C)])[None, :, None]

        x, normed = self._layers(x, rope, keys, scalar, then=self.norm)
        if start is None:
            cache.length = T0 + S
        return self.lm_logits(normed[:, S:], out=out, capped=capped)

    # decoder pass -------------------------------------------------------------------------------
    def decoder_input(self, canvas: torch.Tensor, sc_logits: torch.Tensor | None,
                      sc_mask: torch.Tensor | None, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """post_norm(embed(canvas) + SC-MLP(pre_norm(softmax(sc_logits) @ E * sqrt(H)))); sc_mask [B] bool: rows
        without self-conditioning (a zero signal, as with no logits); scratch: see `soft_embedding`."""
        e = self.embed(canvas)
        if sc_logits is not None:
            soft = self.soft_embedding(sc_logits, scratch) * self.embed_scale(e.dtype, e.device)
            if sc_mask is not None:
                soft = soft * sc_mask.to(soft.dtype)[:, None, None]
            e = e + self.self_conditioning(soft)
        return rms_norm(e, None, self.text.rms_norm_eps)

    def decode(self, canvas: torch.Tensor, cache: KVCache, sc_logits: torch.Tensor | None = None,
               sc_mask: torch.Tensor | None = None, hidden_states: list | None = None,
               return_hidden: bool = False, start: torch.Tensor | None = None,
               out: torch.Tensor | None = None, capped: bool = True) -> torch.Tensor:
        """canvas [B,C] at positions [T, T+C) (T = cache.length) -> fp32 soft-capped logits [B,C,V] (into `out`, an
        fp32 tensor of their shape, when given; capped=False: the product before the cap, see `lm_logits`). Cache
        positions [0, T) are read only.

        Without autograd, where the cache has room, each layer writes the canvas's K/V at [T, T + C) as scratch (the
        commit overwrites it) and attends over one span of the cache: the same keys in the same order as
        concatenating the cached ones and the canvas's, which copied every layer's visible cache once per step (at a
        32K-token context on the 26B model, its full layers' 0.67 GB). start: T on the device, the fixed-shape
        pass (see `encode`; the capacity must hold T + C)."""
        B, C = canvas.shape
        if start is None:
            T = cache.length
            scratch = not torch.is_grad_enabled() and cache.scratch_room(T, C)
        x = self.decoder_input(canvas, sc_logits, sc_mask, out)  # the logits buffer, free until the end, as scratch
        rope = self._rope(T if start is None else start, C, x.dtype, x.device)
        keys = Spans(self, cache, T, 0, C, scratch, x.dtype) if start is None else \
            Fixed(self, cache, start, 0, C, x.dtype)
        if hidden_states is not None:
            hidden_states.append(x)
        _, x = self._layers(x, rope, keys, lambda layer: layer.layer_scalar, hidden_states=hidden_states,
                            checkpoint=self.gradient_checkpointing and torch.is_grad_enabled(), then=self.norm)
        if hidden_states is not None:
            hidden_states.append(x)
        if return_hidden:
            return x
        return self.lm_logits(x, out=out, capped=capped)
