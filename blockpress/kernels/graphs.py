"""Static-shape passes and a CUDA-graph wrapper that replays them.

Shape legend: B batch, S encoder chunk, C canvas length, V vocab, P cache capacity, T0 / T encoded
tokens (cache.length) before / after the chunk.

Each static pass computes the same function as its `DiffusionGemmaModel` method with shapes that never
change inside a generation: attention spans the whole cache capacity P (a sliding layer: a gathered window
[T0 - W, T0 + S) where 3 x that is less than P, `WINDOW_READS`, or where its cache keeps a ring: K/V are written and
gathered at their slots, position modulo the ring, `KVCache.slot_index`), and which keys are visible is decided by
masks built from a *device* tensor T0, never by host slicing. A canvas's K/V are written into the cache
past its length (scratch that the commit overwrites: the capacity must hold the canvas), so attention reads
the cache in place rather than a copy with the canvas appended.
Masked keys get weight exactly 0, so each equals the dynamic pass up to fp32 summation order (tested
on CPU). Nothing in a pass copies from the host: the embedding scale and T0 are device tensors made
before capture.
- `static_decode`: a denoising step (spec 3.4). Self-conditioning always takes a logits buffer plus a
  per-row mask (first step: mask False, which makes the signal exactly 0, as with no logits).
- `static_encode`: the commit pass (spec 3.2) over a chunk without padding; it writes K/V at
  [T0, T0+S) with `index_copy_` on device positions. With S = 1 it is an autoregressive step.
- `static_encode_decode`: a commit fused into the next canvas's first denoising step (one read of the
  weights for both), one attention call per layer with a per-row mask (chunk rows: the encoder rule;
  canvas rows: the whole canvas plus the cache as a decoder sees it after the commit).

`GraphedPasses` (CUDA; `capture=False` runs the same plumbing eagerly, for tests) routes
`module.decode`, `module.encode` (chunks of size 1 or the canvas length, without padding: commits and
AR steps; a prompt's prefill stays eager, as its length varies and it is compute-bound) and
`module.encode_decode` through graphs captured once per pass and shape, and `module.new_cache`
through a pool, so that every generation of a shape reuses one set of cache buffers and the graphs
captured on them: a graph reads the cache at the addresses it was captured with. A cache whose buffers
differ (another live cache, or one regrown by `ensure_capacity`) is recaptured; `captures` counts the
captures, so a benchmark can show that its timed runs replay only. Experts must use a backend without
host synchronisation ("grouped" on Hopper, "triton"). A pass whose capture cannot work (a Triton experts
kernel switched off by its first-use check falls back to a path that reads counts on the host) or fails
runs eagerly on the same buffers, with a warning, instead of raising from inside CUDA.
"""

from __future__ import annotations

import weakref

import torch

from ..config import FULL, SLIDING
from ..engine.cache import KVCache
from ..model.layers import ATTENTION_BACKENDS, additive_mask, rms_norm, rope_cos_sin

SYNC_FREE_EXPERTS = ("grouped", "triton", "triton_checked", "auto")  # "auto": QuantizedExperts picking triton


def decoder_input(module, canvas, sc_logits, sc_mask, scale):
    """`module.decoder_input` with the embedding scale given as a device tensor (spec 2.10) and the
    self-conditioning mask as a tensor, so that one captured graph serves steps with and without logits."""
    w = module.embed_tokens.weight
    e = torch.nn.functional.embedding(canvas, w) * scale
    soft = module.soft_embedding(sc_logits) * scale * sc_mask.to(w.dtype)[:, None, None]  # rows without logits: 0
    return rms_norm(e + module.self_conditioning(soft), None, module.text.rms_norm_eps)


# A sliding layer reads a gathered window of the cache instead of all P positions when that moves fewer bytes: the
# gather reads and writes the window, attention reads it again, so about 3 x its size against P.
WINDOW_READS = 3


class _Window:
    """The positions [T0 - W, T0 + S) of a cache, gathered for the sliding layers: all they can see from rows at
    [T0, T0+S) whose K/V are written there first (an encoder chunk; a canvas, S = C; or both). `idx` [n]
    the sliding layers' slots holding them (positions clamped to 0; modulo the ring where the cache keeps one),
    `kpos` [n] the true positions (negative before the start), `valid` [B, n]."""

    def __init__(self, module, cache, T0, S: int):
        self.kpos = T0 - module.window + torch.arange(module.window + S, device=cache.valid.device)
        pos = self.kpos.clamp(min=0)  # <= T0 + S - 1 < capacity
        self.idx = pos if cache.ring is None else pos % cache.ring
        self.valid = cache.valid.index_select(1, pos) & (self.kpos >= 0)[None]

    @staticmethod
    def of(module, cache, T0, S: int) -> "_Window | None":
        """The window, or None where reading the whole cache is cheaper (a short cache without a ring)."""
        if cache.ring is not None or WINDOW_READS * (module.window + S) < cache.capacity:
            return _Window(module, cache, T0, S)
        return None


def _positions(cache, window):
    """(kpos [P'], valid [B, P']) of the keys a layer reads: the whole cache, or a gathered window."""
    if window is not None:
        return window.kpos, window.valid
    return torch.arange(cache.capacity, device=cache.valid.device), cache.valid


def _seen_by_canvas(module, cache, T, C: int, window=None) -> dict:
    """Per layer type: [B, P] bool (sliding layers [B, n] over `window` when given), the keys a canvas at [T, T+C)
    attends to, its own K/V written at those positions first (spec 3.4: full layers k < T, sliding layers
    T - (W-1) <= k < T, padding from cache.valid; and the whole canvas)."""
    out = {}
    for t in (FULL, SLIDING):
        kpos, valid = _positions(cache, window if t == SLIDING else None)
        seen = (kpos < T)[None] & valid
        if t == SLIDING:
            seen = seen & (kpos >= T - (module.window - 1))[None]
        out[t] = seen | ((kpos >= T) & (kpos < T + C))[None]
    return out


def _cache_seen_by_chunk(module, cache, T0, S: int, window=None) -> dict:
    """Per layer type: [B, S, P] bool (sliding layers [B, S, n] over `window` when given), the cached keys (the
    chunk's own included, written first) that an encoder chunk at [T0, T0+S) attends to (spec 3.2: causal,
    sliding q - W < k <= q; or, with a bidirectional encoder, every k < T0+S, sliding |k - q| <= W)."""
    qpos = (T0 + torch.arange(S, device=cache.valid.device))[:, None]  # [S, 1]
    out = {}
    for t in (FULL, SLIDING):
        kpos, valid = _positions(cache, window if t == SLIDING else None)
        kpos = kpos[None, :]  # [1, P']
        if module.bidirectional_encoder:
            seen = (kpos < T0 + S) & (qpos >= 0)  # [S, P']
            if t == SLIDING:
                seen = seen & ((kpos - qpos).abs() <= module.window)
        else:
            seen = kpos <= qpos
            if t == SLIDING:
                seen = seen & (kpos > qpos - module.window)
        out[t] = seen[None] & valid[:, None, :]
    return out


def _write(cache, i: int, pos, k, v) -> None:
    """Layer i's K/V of positions `pos` (a device tensor) written into its slots (a sliding layer's ring: modulo)."""
    slots = cache.slot_index(i, pos)
    cache.keys[i].index_copy_(2, slots, k)
    cache.values[i].index_copy_(2, slots, v)


def _cached(cache, i: int, full: bool, window):
    """Layer i's cached keys and values as a pass reads them: all P positions, or a sliding layer's window."""
    if full or window is None:
        return cache.keys[i], cache.values[i]
    return cache.keys[i].index_select(2, window.idx), cache.values[i].index_select(2, window.idx)


def _rope(module, T0, n: int, dtype) -> dict:
    pos = T0 + torch.arange(n, device=T0.device)
    return {t: rope_cos_sin(getattr(module, f"inv_freq_{t}"), pos, dtype) for t in (SLIDING, FULL)}


def _scale(module, device, scale):
    return module.embed_scale(module.dtype, device) if scale is None else scale


def _layers(module, x, rope, masks, keys_values, scalar, upto: int | None = None):
    """The layer loop of the static passes (layers [0, upto), default all). keys_values(i, k, v) -> the keys and
    values layer i attends to (writing the cache first where the pass does); scalar(layer) -> the residual scale of
    its rows."""
    attn_fn = ATTENTION_BACKENDS[module.attention_backend]
    for i, layer in enumerate(module.layers[:upto]):
        t = FULL if layer.full else SLIDING
        cos, sin = rope[t]

        def attend(h, i=i, layer=layer, mask=masks[t], cos=cos, sin=sin):
            q, k, v = layer.self_attn.project(h, cos, sin)
            return layer.self_attn.output(attn_fn(q, *keys_values(i, k, v), mask))

        x = layer(x, attend, scalar(layer))
    return x


def static_decode(module, canvas, cache, T, sc_logits, sc_mask, scale=None, out=None):
    """canvas [B,C]; T 0-dim int64 device tensor; sc_logits [B,C,V]; sc_mask [B] bool -> fp32 logits (written
    into `out` [B,C,V] fp32 when given). scale: sqrt(H) in the weight dtype on the device (computed here when not
    given). The canvas's K/V are written
    to the cache at [T, T+C), past its length (scratch that the commit overwrites; the capacity must hold T + C),
    so attention reads the cache in place instead of a copy of it with the canvas appended."""
    B, C = canvas.shape
    x = decoder_input(module, canvas, sc_logits, sc_mask, _scale(module, canvas.device, scale))
    dtype = x.dtype
    rope = _rope(module, T, C, dtype)
    pos = T + torch.arange(C, device=x.device)
    window = _Window.of(module, cache, T, C)
    masks = {t: additive_mask(seen[:, None, None], dtype)  # [B,1,1,P]
             for t, seen in _seen_by_canvas(module, cache, T, C, window).items()}

    def keys_values(i, k, v):  # the canvas's K/V written at [T, T+C); the cache (a sliding layer: its window)
        _write(cache, i, pos, k, v)
        return _cached(cache, i, module.layers[i].full, window)

    x = _layers(module, x, rope, masks, keys_values, lambda layer: layer.layer_scalar)
    return module.lm_logits(module.norm(x), out=out)


def static_encode(module, ids, cache, T0, scale=None, output: bool = True):
    """`module.encode(ids, cache, output=output)` for a chunk without padding, with T0 (= cache.length, 0-dim
    int64) on the device: writes K/V at [T0, T0+S) and returns the final-normed hidden states [B,S,H] (output=False:
    the last layer writes its K/V and stops, and None is returned). The caller advances `cache.length` (a host
    value) and makes sure the capacity holds T0 + S."""
    B, S = ids.shape
    x = torch.nn.functional.embedding(ids, module.embed_tokens.weight) * _scale(module, ids.device, scale)
    rope = _rope(module, T0, S, x.dtype)
    pos = T0 + torch.arange(S, device=ids.device)
    window = _Window.of(module, cache, T0, S)
    masks = {t: additive_mask(seen[:, None], x.dtype)
             for t, seen in _cache_seen_by_chunk(module, cache, T0, S, window).items()}

    def keys_values(i, k, v):  # the chunk's K/V written first; the mask bounds what each row sees
        _write(cache, i, pos, k, v)
        return _cached(cache, i, module.layers[i].full, window)

    last = len(module.layers) - 1
    x = _layers(module, x, rope, masks, keys_values, lambda layer: layer.encoder_layer_scalar,
                upto=None if output else last)
    if output:
        return module.norm(x)
    layer = module.layers[last]  # the cache needs only its K/V
    cos, sin = rope[FULL if layer.full else SLIDING]
    _write(cache, last, pos, *layer.self_attn.project_kv(layer.input_layernorm(x), cos, sin))
    return None


def static_commit(module, ids, cache, T0, scale=None):
    """`static_encode(..., output=False)`: a commit, which only the cache needs."""
    return static_encode(module, ids, cache, T0, scale, output=False)


def static_encode_decode(module, ids, canvas, cache, T0, sc_logits, sc_mask, scale=None, out=None):
    """`module.encode_decode(ids, canvas, cache, None, sc_logits)` with T0 on the device and the
    self-conditioning mask and `out` as in `static_decode`: ids [B,S] at [T0, T0+S) (written to the cache),
    canvas [B,C] at [T0+S, T0+S+C) (written as scratch, as in `static_decode`: the capacity must hold
    T0 + S + C). Returns the canvas's fp32 logits [B,C,V]."""
    B, S = ids.shape
    C = canvas.shape[1]
    scale = _scale(module, ids.device, scale)
    e = torch.nn.functional.embedding(ids, module.embed_tokens.weight) * scale
    x = torch.cat([e, decoder_input(module, canvas, sc_logits, sc_mask, scale)], dim=1)  # [B, S+C, H]
    dtype, dev = x.dtype, x.device
    rope = _rope(module, T0, S + C, dtype)
    pos = T0 + torch.arange(S + C, device=dev)  # the chunk's positions, then the canvas's
    window = _Window.of(module, cache, T0, S + C)  # [T0 - W, T0 + S + C): every sliding key either row kind sees
    by_chunk = _cache_seen_by_chunk(module, cache, T0, S, window)  # [B, S, P] (sliding: [B, S, n]); no canvas
    by_canvas = _seen_by_canvas(module, cache, T0 + S, C, window)  # [B, P] (sliding: [B, n])
    masks = {t: additive_mask(torch.cat([by_chunk[t], by_canvas[t][:, None].expand(B, C, -1)], dim=1)[:, None], dtype)
             for t in (SLIDING, FULL)}  # rows: chunk then canvas

    def keys_values(i, k, v):  # k, v [B, kv, S+C, D]: both segments written, then the cache read in place
        _write(cache, i, pos, k, v)
        return _cached(cache, i, module.layers[i].full, window)

    def scalar(layer):  # the encoder's scale on the chunk's rows, the decoder's on the canvas's
        return torch.cat([layer.encoder_layer_scalar.expand(S), layer.layer_scalar.expand(C)])[None, :, None]

    x = _layers(module, x, rope, masks, keys_values, scalar)
    return module.lm_logits(module.norm(x[:, S:]), out=out)


def _buffers(cache) -> tuple:
    """The addresses a graph captured on `cache` reads and writes."""
    return tuple(t.data_ptr() for t in (*cache.keys, *cache.values, cache.valid))


def _on_buffers(cache) -> KVCache:
    """A new, empty KVCache object on `cache`'s buffers (views of all its rows, length 0)."""
    view = cache.view_rows(0, cache.batch)
    view.length, view.has_padding, view._high = 0, False, [0]
    return view


def capture_blocker(device) -> str | None:
    """Why passes on `device` must not be captured now, or None: a Triton experts kernel that its first-use check
    switched off (moe_grouped.checked_on_first_use) runs its torch fallback, which reads the routing counts on
    the host, and a host read inside a capture is a CUDA error, not a slow pass."""
    from .moe_grouped import FIRST_USE

    off = sorted({k[2] for k, ok in FIRST_USE.items() if ok is False and k[0] == str(device) and "experts" in k[2]})
    return None if not off else f"the {' and the '.join(off)} kernel failed its first-use check on {device}"


class _Captured:
    """One static pass over its own input buffers: captured as a CUDA graph, or (capture=False) run eagerly
    on the same buffers. It keeps the cache tensors it was captured on (not the cache object, which would
    keep a pooled cache in use), so their addresses stay its own while it exists. shared: name -> a tensor the
    pass uses instead of a buffer of its own (an input's, or "out": where it writes its logits), shared with
    other passes (`GraphedPasses.shared`)."""

    def __init__(self, module, fn, inputs: dict, cache, capture: bool, warmup: int, pool=None, shared=None):
        shared = shared or {}
        self.inputs = {}
        for name, (value, shape, dtype) in inputs.items():
            buf = shared.get(name)
            self.inputs[name] = buf = torch.zeros(shape, dtype=dtype, device=cache.valid.device) if buf is None else buf
            if value is not None:
                _set(buf, value)
        self.cache = _on_buffers(cache)
        self.buffers = _buffers(cache)
        self.shared = tuple(t.data_ptr() for t in shared.values())
        out = {"out": shared["out"]} if "out" in shared else {}
        self.out = None  # the pass's output buffer: the graph's (or the shared one), or (no graph) the first result
        def run():  # inference only: no autograd graph (and the out= writes need none)
            with torch.no_grad():
                return fn(module, cache=self.cache, scale=module.embed_scale(module.dtype, module.device),
                          **self.inputs, **out)

        self.fn = run
        self.graph = None
        if not capture:
            return
        dev = cache.valid.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm up (allocator, cuBLAS handles, Triton compiles) off the graph
            for _ in range(warmup):
                self.fn()  # an encoder pass writes the same K/V its replay will write
        torch.cuda.current_stream(dev).wait_stream(side)
        why = capture_blocker(dev)  # the warm-up ran the first-use checks
        if why is None:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.out = self.fn()
                self.graph = graph
            except RuntimeError as e:  # an untried GPU / driver: this pass runs eagerly rather than not at all
                why = f"capturing it failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        if why is not None:
            import warnings

            warnings.warn(f"blockpress: CUDA graphs are off for this pass: {why}; it runs eagerly on the same "
                          "buffers (correct, slower)", RuntimeWarning, stacklevel=2)

    def replay(self, inputs: dict, copy: bool = True) -> torch.Tensor:
        """Run the pass on `inputs`; copy=False returns the pass's own output buffer, which the next replay
        overwrites (without a graph the same: the result is written into one buffer, so CPU tests see what a
        GPU does)."""
        for name, (value, _, _) in inputs.items():
            if value is not None:  # None: the buffer keeps what it holds (a masked-out signal)
                _set(self.inputs[name], value)
        if self.graph is None:
            out = self.fn()
            if out is None:  # a pass that only writes the cache (a commit)
                return None
            if self.out is None:
                self.out = out
            elif out.data_ptr() != self.out.data_ptr():
                self.out.copy_(out)
        else:
            self.graph.replay()
            if self.out is None:
                return None
        return self.out.clone() if copy else self.out


def _set(buf: torch.Tensor, value) -> None:
    if isinstance(value, torch.Tensor):
        if value.data_ptr() == buf.data_ptr() and value.shape == buf.shape and value.stride() == buf.stride():
            return  # the caller wrote into the buffer itself (`GraphedPasses.sc_buffer`): nothing to copy
        if value.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            value = value.clone()  # other rows of the same buffer: copy_ must not read what it writes
        buf.copy_(value)
    else:  # a host scalar: a fill kernel with the value as its argument, no host-to-device copy
        buf.fill_(value)


class GraphedPasses:
    """Routes a DiffusionGemmaModel's decode / encode / encode_decode / new_cache through captured graphs
    (see the module docstring). `capture=False` runs the same static passes and plumbing without graphs.

    Shared buffers: every captured decode and fused commit writes its fp32 logits into rows [0, B) of one buffer
    (per canvas length), and reads its self-conditioning logits from rows [0, B) of another, whatever its batch
    size B: one [B, C, V] fp32 output for all passes and batch sizes instead of one per captured graph (0.27 GB
    per row on the 26B model; a server capturing batch sizes 1..8 would otherwise hold 36 of them per pass). A
    caller that writes the next pass's self-conditioning logits into `sc_buffer(B, C)` saves the copy into it
    (0.13 GB written and read per step on the 26B model). The buffers grow (to `reserve`'s row count when more
    than the batch) and the passes on the old ones are captured again.

    copy_outputs=False: decode and encode_decode return the shared logits buffer instead of a copy, valid
    until the next decode or fused commit (the [B, C, V] fp32 copy is 0.27 GB of memory and 0.54 GB of traffic
    per step on the 26B model). For the engine's canvas loop, which consumes a step's logits before the next pass
    and keeps only new tensors (the sampler's z, the self-conditioning logits in the model dtype); an fp32 model
    still gets copies (without `sc_buffer` its self-conditioning logits are the logits tensor itself)."""

    def __init__(self, module, warmup: int = 2, capture: bool = True, encode_sizes=None, copy_outputs: bool = True):
        on_cuda = torch.cuda.is_available() and module.device.type == "cuda"
        if capture and not on_cuda:
            raise RuntimeError("CUDA graphs need the model on a CUDA device (capture=False runs the static passes "
                               "without graphs)")
        busy = {getattr(layer.experts, "backend", "?") for layer in module.layers} - set(SYNC_FREE_EXPERTS)
        if capture and busy:
            raise ValueError(f"experts backend(s) {sorted(busy)} synchronise with the host and cannot be captured; "
                             "call module.set_experts_backend('grouped') or 'triton' first")
        self.module, self.warmup, self.capture = module, warmup, capture
        self.copy_outputs = copy_outputs or module.dtype == torch.float32
        self.encode_sizes = set(encode_sizes or (1, module.config.canvas_length))
        self.captured: dict = {}  # (pass, shapes) -> _Captured on the latest buffers only
        self.captures = 0
        # One memory pool for every captured pass: their intermediates overlap instead of adding up (decode and a
        # fused commit each peak at ~0.14 GB on the 26B model besides their logits). Safe because passes replay one
        # at a time on one stream, and a graph's output tensor stays alive with it, so no later capture places
        # anything on it. The logits of decode and fused commits are written into the shared buffer, outside it.
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        self._shared: dict = {}  # (name, C) -> [rows, C, V]: "out" (fp32 logits), "sc_logits" (model dtype)
        self._rows_hint = 0
        self._pool: dict = {}  # (batch, capacity) -> (a cache object on the buffers, weakref to the one handed out)
        self._eager = {name: getattr(module, name) for name in ("decode", "encode", "encode_decode", "new_cache")}

    # graphs ---------------------------------------------------------------------------------------------
    def _run(self, name: str, key: tuple, cache, fn, inputs: dict, copy: bool = True, shared=None) -> torch.Tensor:
        """Replay the pass (name, key) captured on this cache's buffers and these shared buffers (capturing it
        first when there is none) with `inputs`: name -> (tensor, python scalar or None, shape, dtype)."""
        g = self.captured.get((name, key))
        if g is None or g.buffers != _buffers(cache) or g.shared != tuple(t.data_ptr() for t in (shared or {}).values()):
            self.captured.pop((name, key), None)  # its graph and memory pool go before the new capture
            with torch.no_grad():
                g = self.captured[(name, key)] = _Captured(self.module, fn, inputs, cache, self.capture, self.warmup,
                                                           self._graph_pool, shared)
            self.captures += 1
        return g.replay(inputs, copy)

    def _shared_rows(self, name: str, B: int, C: int) -> torch.Tensor:
        """Rows [0, B) of the shared buffer `name` for canvases of C, grown (and the passes on the old buffer
        dropped, to be captured again on the new one) when it has fewer rows."""
        buf = self._shared.get((name, C))
        if buf is None or buf.shape[0] < B:
            if buf is not None:
                old = buf.data_ptr()
                self.captured = {k: g for k, g in self.captured.items() if old not in g.shared}
                del buf
            m = self.module
            dtype = torch.float32 if name == "out" else m.dtype
            buf = self._shared[(name, C)] = torch.zeros(max(B, self._rows_hint), C, m.text.vocab_size, dtype=dtype,
                                                        device=m.device)
        return buf[:B]

    def sc_buffer(self, batch: int, canvas_length: int) -> torch.Tensor:
        """The self-conditioning input of the decode and fused-commit passes of this batch size, [B, C, V] in the
        model dtype: write a step's self-conditioning logits here and pass this tensor as `sc_logits`, and the pass
        reads them where they are (no copy). Valid until the buffer grows (a larger batch than any before)."""
        return self._shared_rows("sc_logits", batch, canvas_length)

    def reserve(self, rows: int) -> None:
        """Grow the shared buffers to at least `rows` rows when they next grow (a server: its slots' row count), so
        that a batch growing one row at a time does not regrow them, and recapture, at every size."""
        self._rows_hint = max(self._rows_hint, rows)

    def _sc(self, canvas, sc_logits, sc_mask) -> dict:
        """Self-conditioning inputs: no logits -> the mask is False and the logits buffer is not written."""
        B, C = canvas.shape
        m = self.module
        mask = False if sc_logits is None else (True if sc_mask is None else sc_mask)
        return {"sc_logits": (sc_logits, (B, C, m.text.vocab_size), m.dtype),
                "sc_mask": (mask, (B,), torch.bool)}

    def _logits_io(self, canvas) -> dict:
        """The shared buffers of a pass producing a canvas's logits: its self-conditioning input and its output."""
        B, C = canvas.shape
        return {"sc_logits": self._shared_rows("sc_logits", B, C), "out": self._shared_rows("out", B, C)}

    def decode(self, canvas, cache, sc_logits=None, sc_mask=None, **kwargs):
        if kwargs:  # hidden states etc.: not captured, use the eager pass
            return self._eager["decode"](canvas, cache, sc_logits, sc_mask, **kwargs)
        T, C = cache.length, canvas.shape[1]
        cache.ensure_capacity(T + C, write=C)  # the canvas's K/V go to [T, T+C) (new_cache: room)
        inputs = {"canvas": (canvas, canvas.shape, torch.long), "T": (T, (), torch.long),
                  **self._sc(canvas, sc_logits, sc_mask)}
        out = self._run("decode", tuple(canvas.shape), cache, static_decode, inputs, self.copy_outputs,
                        self._logits_io(canvas))
        cache.note_write(T, C)  # scratch past the length: a ring's oldest positions give way to it
        return out

    def encode(self, ids, cache, pad_mask=None, hidden_states=None, inputs_embeds=None, output=True):
        B, S = ids.shape
        if pad_mask is not None or hidden_states is not None or inputs_embeds is not None or S not in self.encode_sizes:
            return self._eager["encode"](ids, cache, pad_mask=pad_mask, hidden_states=hidden_states,
                                         inputs_embeds=inputs_embeds, output=output)
        T0 = cache.length
        cache.ensure_capacity(T0 + S, write=S)
        inputs = {"ids": (ids, ids.shape, torch.long), "T0": (T0, (), torch.long)}
        # a commit (output=False) is a pass of its own: the last layer writes its K/V and stops
        out = self._run("encode" if output else "commit", (B, S), cache, static_encode if output else static_commit,
                        inputs)
        cache.note_write(T0, S)
        cache.length = T0 + S
        return out

    def encode_decode(self, ids, canvas, cache, pad_mask=None, sc_logits=None, sc_mask=None):
        if pad_mask is not None:
            return self._eager["encode_decode"](ids, canvas, cache, pad_mask, sc_logits, sc_mask)
        T0, S, C = cache.length, ids.shape[1], canvas.shape[1]
        cache.ensure_capacity(T0 + S + C, write=S + C)
        inputs = {"ids": (ids, ids.shape, torch.long), "canvas": (canvas, canvas.shape, torch.long),
                  "T0": (T0, (), torch.long), **self._sc(canvas, sc_logits, sc_mask)}
        out = self._run("encode_decode", (tuple(ids.shape), tuple(canvas.shape)), cache, static_encode_decode, inputs,
                        self.copy_outputs, self._logits_io(canvas))
        cache.note_write(T0, S + C)
        cache.length = T0 + S
        return out

    # cache pool -----------------------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, ring: bool = True) -> KVCache:
        """An empty cache on the pooled buffers of (batch, capacity) when the cache last handed out on them is
        gone (stale keys past `length` are never visible), else on new buffers, which join the pool. The static
        passes write a canvas's K/V past the cache's length: `generate` asks for that room after its last commit
        (as the eager passes use it too), and a decoder pass on a cache without it grows the cache first."""
        entry = self._pool.get((batch, capacity, ring))
        if entry is not None and entry[1]() is None:
            cache = _on_buffers(entry[0])
            cache.view = False  # handed out as a cache of its own (its layout may change: new buffers then)
            cache.valid.fill_(True)
        else:
            cache = self._eager["new_cache"](batch, capacity, ring)
        self._pool[(batch, capacity, ring)] = (_on_buffers(cache), weakref.ref(cache))
        return cache

    def eager(self, name: str):
        """The module's own (uncaptured) pass `name`: for work that must not be captured, such as a server's
        prefill into rows of its graphs' buffers (a capture there would evict the commit's graph)."""
        return self._eager[name]

    def release(self, keep: KVCache | None = None) -> None:
        """Drop every captured pass except those on `keep`'s buffers, so that the memory of caches no longer used
        (and of their graphs) can go."""
        mine = None if keep is None else _buffers(keep)
        for key in [k for k, g in self.captured.items() if g.buffers != mine]:
            del self.captured[key]

    def install(self) -> "GraphedPasses":
        for name in self._eager:  # instance attributes shadow the methods for the engine loop
            setattr(self.module, name, getattr(self, name))
        self.module.__dict__["_graphed_passes"] = self  # installed(module) finds it (a server's scheduler)
        return self

    def uninstall(self) -> None:
        for name in (*self._eager, "_graphed_passes"):
            if name in self.module.__dict__:
                delattr(self.module, name)
        self.captured.clear()
        self._pool.clear()
        self._shared.clear()


def installed(module) -> GraphedPasses | None:
    """The GraphedPasses installed on `module`, or None."""
    return vars(module).get("_graphed_passes")
