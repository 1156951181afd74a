"""CUDA graphs of the model's own passes, replayed on fixed buffers.

Shape legend: B batch, S encoder chunk, C canvas length, V vocab, P cache capacity, T0 / T encoded tokens
(cache.length) before / after the chunk.

`GraphedPasses` runs `decode`, `encode` (chunks of size 1 or the canvas length, without padding: commits and AR
steps; a prompt's prefill stays eager, as its length varies and it is compute-bound) and `encode_decode` of a
`DiffusionGemmaModel` in their fixed-shape form (`start=` a device position: model/keys.py `Fixed`), each
captured once per pass, shape and cache capacity, and hands out caches from a pool (`new_cache`), so that every
generation of a shape reuses one set of cache buffers and the graphs captured on them: a graph reads the cache at
the addresses it was captured with. The engine asks for capacities rounded up to powers of two
(`model.cache.rounded_capacity`), so a loop over prompts of many lengths meets a few sizes, each captured once. A
cache whose buffers differ (another live cache, or one regrown by `ensure_capacity`) is recaptured; `captures`
counts the captures, so a benchmark can show that its timed runs replay only. The host
bookkeeping of the cache (its capacity, `note_write`, `length`) is done here, around the replay.

`capture=False` (a CPU) runs the same passes on the same buffers without a graph: what the tests check. Experts
must use a backend without host synchronisation ("grouped" on Hopper, "triton"). A pass whose capture cannot
work (a Triton experts kernel switched off by its first-use check falls back to a path that reads counts on the
host) or fails runs eagerly on the same buffers, with a warning, instead of raising from inside CUDA.

Nothing in a pass copies from the host: the embedding scale and positions are device tensors made before capture.
"""

from __future__ import annotations

import weakref

import torch

from ..kernels.select import host_syncs
from ..model.cache import KVCache

# the passes as graphs call them: the model's own methods, with the position on the device
def _decode(module, cache, canvas, T, sc_logits=None, sc_mask=None, out=None, capped=True):
    return module.decode(canvas, cache, sc_logits, sc_mask, start=T, out=out, capped=capped)


def _encode(module, cache, ids, T0):
    return module.encode(ids, cache, start=T0)


def _commit(module, cache, ids, T0):  # a commit only the cache needs: the last layer writes its K/V and stops
    return module.encode(ids, cache, output=False, start=T0)


def _encode_decode(module, cache, ids, canvas, T0, sc_logits=None, sc_mask=None, out=None, capped=True):
    return module.encode_decode(ids, canvas, cache, None, sc_logits, sc_mask, start=T0, out=out, capped=capped)


def _uncapped(fn):
    """The pass `fn` returning the LM head's product before the soft cap (`lm_logits(capped=False)`)."""
    return lambda *args, **kw: fn(*args, **kw, capped=False)


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
    from ..kernels.moe_grouped import FIRST_USE

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
        out = {"out": shared[k] for k in ("out", "product") if k in shared}
        self.out = None  # the pass's output buffer: the graph's (or the shared one), or (no graph) the first result
        def run():  # inference only: no autograd graph (and the out= writes need none)
            with torch.no_grad():
                return fn(module, self.cache, **self.inputs, **out)

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
    """A DiffusionGemmaModel's decode / encode / encode_decode / new_cache, through captured graphs (see the module
    docstring); what the engine's runner calls instead of the module. `capture=False` runs the same passes and
    plumbing without graphs.

    Shared buffers: every captured decode and fused commit writes its fp32 logits into rows [0, B) of one buffer
    (per canvas length; capped=False, the fast sampler's passes: the LM head's product in the model dtype, into
    another, "product"), and reads its self-conditioning logits from rows [0, B) of another, whatever its batch
    size B: one [B, C, V] output for all passes and batch sizes instead of one per captured graph (0.27 GB in fp32
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
            raise RuntimeError("CUDA graphs need the model on a CUDA device (capture=False runs the same passes "
                               "without graphs)")
        busy = host_syncs(module)
        if capture and busy:
            raise ValueError(f"experts kernel(s) {busy} synchronise with the host and cannot be captured; choose "
                             "experts='grouped' or 'triton' (the default on a GPU)")
        self.module, self.warmup, self.capture = module, warmup, capture
        self.copy_outputs = copy_outputs or module.dtype == torch.float32
        self.encode_sizes = set(encode_sizes or (1, module.config.canvas_length))
        self.captured: dict = {}  # (pass, shapes, cache capacity) -> _Captured on the latest buffers of that size
        self.captures = 0
        # One memory pool for every captured pass: their intermediates overlap instead of adding up (decode and a
        # fused commit each peak at ~0.14 GB on the 26B model besides their logits). Safe because passes replay one
        # at a time on one stream, and a graph's output tensor stays alive with it, so no later capture places
        # anything on it. The logits of decode and fused commits are written into the shared buffer, outside it.
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        # (name, C) -> [rows, C, V]: "out" (fp32 logits), "product" and "sc_logits" (model dtype)
        self._shared: dict = {}
        self._rows_hint = 0
        self._pool: dict = {}  # (batch, capacity) -> (a cache object on the buffers, weakref to the one handed out)

    # graphs ---------------------------------------------------------------------------------------------
    def _run(self, name: str, key: tuple, cache, fn, inputs: dict, copy: bool = True, shared=None) -> torch.Tensor:
        """Replay the pass (name, key) captured on this cache's buffers and these shared buffers (capturing it
        first when there is none) with `inputs`: name -> (tensor, python scalar or None, shape, dtype)."""
        slot = (name, key, cache.capacity)  # one per cache size: a loop over prompts of a few sizes only replays
        g = self.captured.get(slot)
        if g is None or g.buffers != _buffers(cache) or g.shared != tuple(t.data_ptr() for t in (shared or {}).values()):
            if self.captured.pop(slot, None) is not None:  # its graph goes before the new capture
                self._prune()  # and the pooled buffers only it read
            with torch.no_grad():
                g = self.captured[slot] = _Captured(self.module, fn, inputs, cache, self.capture, self.warmup,
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
        """Self-conditioning inputs; none for a pass without logits (a canvas's first step), which is a pass of its
        own (`_name`): it skips the soft embedding and the self-conditioning MLP, which a pass with the inputs
        would run on a zero mask (on the 26B model a softmax over [256, 262,144], a product with the 1.48 GB
        table and the MLP: ~0.7 ms of an H100 step, once a canvas)."""
        if sc_logits is None:
            return {}
        B, C = canvas.shape
        m = self.module
        return {"sc_logits": (sc_logits, (B, C, m.text.vocab_size), m.dtype),
                "sc_mask": (True if sc_mask is None else sc_mask, (B,), torch.bool)}

    @staticmethod
    def _name(name: str, capped: bool, sc_logits) -> str:
        """The captured pass: with or without self-conditioning inputs, the capped logits or the product."""
        return name + ("" if capped else "_product") + ("" if sc_logits is not None else "_nosc")

    def _logits_io(self, canvas, capped: bool, sc: bool = True) -> dict:
        """The shared buffers of a pass producing a canvas's logits: its self-conditioning input (sc) and its
        output."""
        B, C = canvas.shape
        out = "out" if capped else "product"
        return {**({"sc_logits": self._shared_rows("sc_logits", B, C)} if sc else {}),
                out: self._shared_rows(out, B, C)}

    def decode(self, canvas, cache, sc_logits=None, sc_mask=None, capped: bool = True):
        T, C = cache.length, canvas.shape[1]
        cache.ensure_capacity(T + C, write=C)  # the canvas's K/V go to [T, T+C) (new_cache: room)
        inputs = {"canvas": (canvas, canvas.shape, torch.long), "T": (T, (), torch.long),
                  **self._sc(canvas, sc_logits, sc_mask)}
        out = self._run(self._name("decode", capped, sc_logits), tuple(canvas.shape), cache,
                        _decode if capped else _uncapped(_decode), inputs, self.copy_outputs,
                        self._logits_io(canvas, capped, sc_logits is not None))
        cache.note_write(T, C)  # scratch past the length: a ring's oldest positions give way to it
        return out

    def encode(self, ids, cache, pad_mask=None, output=True):
        B, S = ids.shape
        if pad_mask is not None or S not in self.encode_sizes:  # a prompt: its length varies, it runs eagerly
            return self.module.encode(ids, cache, pad_mask=pad_mask, output=output)
        T0 = cache.length
        cache.ensure_capacity(T0 + S, write=S)
        inputs = {"ids": (ids, ids.shape, torch.long), "T0": (T0, (), torch.long)}
        # a commit (output=False) is a pass of its own: the last layer writes its K/V and stops
        out = self._run("encode" if output else "commit", (B, S), cache, _encode if output else _commit,
                        inputs)
        cache.note_write(T0, S)
        cache.length = T0 + S
        return out

    def encode_decode(self, ids, canvas, cache, pad_mask=None, sc_logits=None, sc_mask=None, capped: bool = True):
        if pad_mask is not None:
            return self.module.encode_decode(ids, canvas, cache, pad_mask, sc_logits, sc_mask, capped=capped)
        T0, S, C = cache.length, ids.shape[1], canvas.shape[1]
        cache.ensure_capacity(T0 + S + C, write=S + C)
        inputs = {"ids": (ids, ids.shape, torch.long), "canvas": (canvas, canvas.shape, torch.long),
                  "T0": (T0, (), torch.long), **self._sc(canvas, sc_logits, sc_mask)}
        out = self._run(self._name("encode_decode", capped, sc_logits),
                        (tuple(ids.shape), tuple(canvas.shape)), cache,
                        _encode_decode if capped else _uncapped(_encode_decode), inputs, self.copy_outputs,
                        self._logits_io(canvas, capped, sc_logits is not None))
        cache.note_write(T0, S + C)
        cache.length = T0 + S
        return out

    # cache pool -----------------------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int, ring: bool = True) -> KVCache:
        """An empty cache on the pooled buffers of (batch, capacity) when the cache last handed out on them is
        gone (stale keys past `length` are never visible), else on new buffers, which join the pool. The
        fixed-shape passes write a canvas's K/V past the cache's length: `generate` asks for that room after its last commit
        (as the eager passes use it too), and a decoder pass on a cache without it grows the cache first.

        The pool keeps a shape's buffers while a cache handed out on them is alive or a captured pass reads them
        (reusing them saves its captures); others go first. With capacities rounded to powers of two a run of
        prompts of new lengths holds one cache per size met (at most twice the largest's bytes in all), not one
        per length."""
        key = (batch, capacity, ring)
        self._prune(keep=key)
        entry = self._pool.get(key)
        if entry is not None and entry[1]() is None:
            cache = _on_buffers(entry[0])
            cache.view = False  # handed out as a cache of its own (its layout may change: new buffers then)
            cache.valid.fill_(True)
        else:
            cache = self.module.new_cache(batch, capacity, ring)
        self._pool[key] = (_on_buffers(cache), weakref.ref(cache))
        return cache

    def _prune(self, keep: tuple | None = None) -> None:
        """Forget the pooled buffers that no live cache and no captured pass uses (except the pool key `keep`)."""
        captured = {g.buffers for g in self.captured.values()}
        for k in [k for k, (c, ref) in self._pool.items()
                  if k != keep and ref() is None and _buffers(c) not in captured]:
            del self._pool[k]

    def release(self, keep: KVCache | None = None) -> None:
        """Drop every captured pass except those on `keep`'s buffers, so that the memory of caches no longer used
        (and of their graphs) can go."""
        mine = None if keep is None else _buffers(keep)
        for key in [k for k, g in self.captured.items() if g.buffers != mine]:
            del self.captured[key]


def passes_for(module, current, cuda_graphs: bool, compiled: bool, recapture: bool):
    """The passes the engine runs for `module`: the module's own span passes, or its fixed-shape passes on fixed
    buffers (`GraphedPasses`) where they are captured as CUDA graphs (a CPU: the same plumbing without capture) or
    compiled (torch.compile is for fixed shapes). `current`: the passes so far, kept unless `recapture` (the kernels
    or the storage changed under them)."""
    if not (cuda_graphs or compiled):
        return module
    capture = cuda_graphs and module.device.type == "cuda"
    if isinstance(current, GraphedPasses) and current.capture == capture and not recapture:
        return current
    return GraphedPasses(module, capture=capture, copy_outputs=False)
