"""Which keys each query attends to, and where a pass writes its K/V: the visibility rules of the two passes.

Shape legend: B batch, S encoder chunk, C canvas length, L keys read, P cache capacity, W sliding window.

The rules, written once (`encoder_sees`, `decoder_sees`) and applied to a set of key positions:
- encoder (commit / prompt) query at q: causal, keys k <= q; sliding layers also k > q - W. A bidirectional
  encoder: every k of the prompt, sliding layers |k - q| <= W. Left padding (`cache.valid`) is never seen.
- decoder (canvas at [T, T+C)): the cached keys k < T (sliding layers k >= T - (W-1)) that are not padding, and
  the whole canvas.

A pass reads its keys in one of two ways (`KeyAccess`):
- `Spans` (positions given as host ints: the eager passes): each layer type reads the span of positions that
  can be visible, [lo, hi), as a view of the cache; a canvas's own K/V are written past the cache's length
  (scratch the commit overwrites) or concatenated. Masks only where something in the span is hidden.
- `Fixed` (positions given as a device tensor: CUDA graphs, torch.compile): shapes that never change inside a
  generation. Attention spans the whole capacity P, or, for a sliding layer, a gathered window [T0 - W, T0 + S)
  where three reads of that are less than P (`WINDOW_READS`) or where its cache keeps a ring; K/V are written with
  `index_copy_` at device positions; visibility comes from masks built from the device position, never from
  host slicing. Masked keys get weight exactly 0, so both ways compute the same function up to fp32 summation
  order (tested on CPU). Where the model's `ops.fixed_attention` is set (opt-in: kernels/attention_fixed.py), no
  mask and no window are built: that kernel reads each layer's buffers in place, the same rules as index math.
"""

from __future__ import annotations

import torch

from ..config import FULL, SLIDING
from .layers import additive_mask

# A sliding layer reads a gathered window of the cache instead of all P positions when that moves fewer bytes: the
# gather reads and writes the window, attention reads it again, so about 3 x its size against P.
WINDOW_READS = 3


def encoder_sees(model, t: str, qpos: torch.Tensor, kpos: torch.Tensor, end) -> torch.Tensor:
    """[S, L] bool: encoder queries at `qpos` [S] see keys at `kpos` [L] in layer type t (`end`: one past the
    chunk's last position, which a bidirectional encoder's keys stay below)."""
    q, k = qpos[:, None], kpos[None, :]
    if model.bidirectional_encoder:
        seen = (k < end) & (q >= 0)
        return seen & ((k - q).abs() <= model.window) if t == SLIDING else seen
    seen = k <= q
    return seen & (k > q - model.window) if t == SLIDING else seen


def decoder_sees(model, t: str, T, C: int, kpos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: a canvas at [T, T+C) sees keys at `kpos` [L] in layer type t (`valid` [B, L]: not padding)."""
    seen = (kpos < T)[None] & valid
    if t == SLIDING:
        seen = seen & (kpos >= T - (model.window - 1))[None]
    return seen | ((kpos >= T) & (kpos < T + C))[None]


def pass_sees(model, t: str, T0, S: int, C: int, kpos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, S+C, L] bool (a canvas alone: [B, 1, L], one row for all): what the rows of a pass see of keys at `kpos`
    [L] (`valid` [B, L]): an encoder chunk at [T0, T0+S) by the encoder's rule (its own K/V written first), then a
    canvas of C by the decoder's rule after it."""
    rows = []
    if S:  # [B, S, L]
        q = T0 + torch.arange(S, device=kpos.device)
        rows.append(encoder_sees(model, t, q, kpos, T0 + S)[None] & valid[:, None, :])
    if C:  # [B, C | 1, L]
        seen = decoder_sees(model, t, T0 + S, C, kpos, valid)
        rows.append(seen[:, None] if not S else seen[:, None].expand(valid.shape[0], C, -1))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


class KeyAccess:
    """Per pass: `attend(layer, t, q, k, v, attn)` writes a layer's new K/V where the pass writes them, reads the keys
    its queries may see and returns the attention output; `write(layer, t, k, v)` only writes (the last layer of an
    encoder pass that only the cache needs). `layer` is what `layer(i)` gives for layer i."""

    fixed = False  # fixed shapes (device positions): what CUDA graphs capture and compiled blocks run

    def layer(self, i: int):
        """How attend/write name layer i: its index here."""
        return i


def _not_traced() -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError("a span pass (host positions) was traced by torch.compile: compile the fixed-shape "
                           "passes only (model/keys.py Fixed)")


class Spans(KeyAccess):
    """Eager: keys read as spans of positions [lo, hi) of the cache (host ints), one attention call per segment of
    rows (an encoder chunk at [T0, T0+S); a canvas after it)."""

    def __init__(self, model, cache, T0: int, S: int, C: int, scratch: bool, dtype):
        self.cache, self.T0, self.S, self.C, self.scratch = cache, T0, S, C, scratch
        dev = cache.valid.device
        self.enc = self._encoder(model, T0, S, dtype, dev) if S else None
        self.dec = self._decoder(model, T0 + S, C, dtype, dev) if C else None

    def _encoder(self, model, T0, S, dtype, dev) -> dict:
        """Per layer type: (first visible position lo, additive mask [B|1, 1, S, T0+S-lo])."""
        pos = torch.arange(T0, T0 + S, device=dev)
        W, out = model.window, {}
        for t in (SLIDING, FULL):
            lo = 0 if t == FULL else max(0, T0 - W) if model.bidirectional_encoder else max(0, T0 - W + 1)
            kp = torch.arange(lo, T0 + S, device=dev)
            if model.bidirectional_encoder and t == FULL:
                allowed = torch.ones(S, kp.numel(), dtype=torch.bool, device=dev)
            else:
                allowed = encoder_sees(model, t, pos, kp, T0 + S)
            allowed = allowed[None, None]  # [1,1,S,L]
            if self.cache.has_padding:
                allowed = allowed & self.cache.valid[:, None, None, lo:T0 + S]
            out[t] = (lo, additive_mask(allowed, dtype))
        return out

    def _decoder(self, model, T, C, dtype, dev) -> dict:
        """Per layer type: (lo, additive padding mask [B, 1, 1, T+C-lo] or None): every canvas query sees cache
        [lo, T) and the whole canvas."""
        out = {}
        for t, lo in ((FULL, 0), (SLIDING, max(0, T - (model.window - 1)))):
            mask = None
            if self.cache.has_padding:
                kp = torch.arange(lo, T + C, device=dev)
                valid = torch.cat([self.cache.valid[:, lo:T], torch.ones(self.cache.valid.shape[0], C,
                                                                        dtype=torch.bool, device=dev)], dim=1)
                mask = additive_mask(decoder_sees(model, t, T, C, kp, valid)[:, None, None], dtype)
            out[t] = (lo, mask)
        return out

    # Host positions change every canvas: traced by torch.compile they would recompile at each, or turn symbolic,
    # which gave wrong numbers in torch 2.13 (a prompt's encode, then a decode). So compiled blocks run the
    # fixed-shape passes only (`DiffusionGemmaModel._layers`), and a span pass refuses to be traced. (Not
    # `torch.compiler.disable`: applying it imports torch._dynamo, ~1 s of every command's start.)
    def write(self, i, t, k, v) -> None:
        _not_traced()
        self.cache.write(i, k, v, self.T0)

    def attend(self, i, t, q, k, v, attn):
        _not_traced()
        cache, T0, S, C = self.cache, self.T0, self.S, self.C
        T = T0 + S
        if not C:  # an encoder chunk: its K/V first, then the span it sees
            cache.write(i, k, v, T0)
            lo, mask = self.enc[t]
            return attn(q, *cache.span(i, lo, T), mask)
        if self.scratch:  # the canvas's K/V too, past the chunk: read in place with the cache
            cache.write(i, k, v, T0)
        elif S:
            cache.write(i, k[:, :, :S], v[:, :, :S], T0)
        out_e = None
        if S:  # the chunk's rows: the encoder's span (its own K/V written first)
            lo_e, mask_e = self.enc[t]
            out_e = attn(q[:, :, :S], *cache.span(i, lo_e, T), mask_e)
        qd = q[:, :, S:] if S else q
        lo, mask = self.dec[t]
        if self.scratch:
            out_d = attn(qd, *cache.span(i, lo, T + C), mask)
        else:
            dk, dv = cache.span(i, lo, T)
            kd, vd = (k[:, :, S:], v[:, :, S:]) if S else (k, v)
            out_d = attn(qd, torch.cat([dk, kd], 2), torch.cat([dv, vd], 2), mask)
        return out_d if out_e is None else torch.cat([out_e, out_d], 2)


class _Window:
    """The positions [T0 - W, T0 + S) of a cache, gathered for the sliding layers: all they can see from rows at
    [T0, T0+S) whose K/V are written there first. `idx` [n] the sliding layers' slots holding them (positions
    clamped to 0; modulo the ring where the cache keeps one), `kpos` [n] the true positions (negative before the
    start), `valid` [B, n]."""

    def __init__(self, model, cache, T0, S: int):
        self.kpos = T0 - model.window + torch.arange(model.window + S, device=cache.valid.device)
        pos = self.kpos.clamp(min=0)  # <= T0 + S - 1 < capacity
        self.idx = pos if cache.ring is None else pos % cache.ring
        self.valid = cache.valid.index_select(1, pos) & (self.kpos >= 0)[None]

    @staticmethod
    def of(model, cache, T0, S: int) -> "_Window | None":
        """The window, or None where reading the whole cache is cheaper (a short cache without a ring)."""
        if cache.ring is not None or WINDOW_READS * (model.window + S) < cache.capacity:
            return _Window(model, cache, T0, S)
        return None


class Fixed(KeyAccess):
    """Fixed shapes: rows at device positions [T0, T0 + S + C) (an encoder chunk of S, then a canvas of C) write
    their K/V there and attend over the whole cache (or a sliding layer's gathered window) with one mask per row."""

    fixed = True

    def __init__(self, model, cache, T0: torch.Tensor, S: int, C: int, dtype):
        self.cache, self.model, self.T0, self.S = cache, model, T0, S
        dev = cache.valid.device
        self.pos = T0 + torch.arange(S + C, device=dev)
        # the kernel that reads the cache in place (`ops.fixed_attention`), where a model's rules are its: not a
        # bidirectional encoder's rows
        kernel = model.ops.fixed_attention
        self.kernel = kernel if not (S and model.bidirectional_encoder) else None
        self.window, self.masks = None, None
        if self.kernel is None:
            self.window = _Window.of(model, cache, T0, S + C)
            self.masks = {t: additive_mask(pass_sees(model, t, T0, S, C, *self._positions(t))[:, None], dtype)
                          for t in (SLIDING, FULL)}  # [B, 1, S+C | 1, P']
        self.slots = {t: cache.kind_slots(t == SLIDING, self.pos) for t in (SLIDING, FULL)}

    def layer(self, i: int):
        """Layer i's K/V buffers: tensors, where an index would be a constant a compiled block specialises on (one
        graph per layer instead of one per kind of layer; the 26B model has 30 layers of two kinds)."""
        return self.cache.keys[i], self.cache.values[i]

    def _positions(self, t: str):
        """(kpos [P'], valid [B, P']) of the keys a layer of type t reads: the whole cache, or the window."""
        if t == SLIDING and self.window is not None:
            return self.window.kpos, self.window.valid
        return torch.arange(self.cache.capacity, device=self.cache.valid.device), self.cache.valid

    def write(self, layer, t, k, v) -> None:
        keys, values = layer
        keys.index_copy_(2, self.slots[t], k)
        values.index_copy_(2, self.slots[t], v)

    def attend(self, layer, t, q, k, v, attn):
        self.write(layer, t, k, v)
        keys, values = layer
        if self.kernel is not None:
            sliding = t == SLIDING
            return self.kernel(q, keys, values, self.cache.valid, self.T0, self.S, self.model.window if sliding else 0,
                               sliding and self.cache.ring is not None)
        if t == SLIDING and self.window is not None:
            keys, values = keys.index_select(2, self.window.idx), values.index_select(2, self.window.idx)
        return attn(q, keys, values, self.masks[t])
