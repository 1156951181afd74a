"""Canvas-level batching: one thread owns the model and denoises every admitted request together.

Design (continuous batching at canvas granularity):
- Requests wait in a bounded queue (`QueueFull` when it is full: the server answers 429).
- The scheduler keeps one *group*: rows sharing a batched KV cache whose `length` is the same for
  every row. At each canvas boundary it (1) drops finished and cancelled rows, (2) encodes the
  committed canvas of the continuing rows, (3) admits waiting requests, (4) denoises one canvas
  for all rows, (5) commits it. A request arriving while a canvas is denoised joins at the next
  boundary.
- A joining prompt of S tokens is left-padded so that it ends where the group's cache ends (E):
  it is encoded at positions [E - S, E) into its own cache and concatenated to the group's.
  Attention depends on position differences only (RoPE), so a padded row computes what it would
  compute alone. A prompt joins when S <= E and the padding E - S <= `max_padding`; otherwise it
  waits (E grows by one canvas per boundary; when the group drains, a fresh one starts at 0).
- Reproducible seeds: every request has its own `torch.Generator` and the sampler runs per row
  (initial canvas, multinomial, renoise in the reference's order), so the random draws of a row
  never depend on its neighbours. The decoder pass is batched; for a request served alone the
  tokens equal `BlockDiffusionLM.generate(generator=torch.Generator().manual_seed(seed))`, and in a
  batch they differ only if float rounding of the batched matmuls flips a near-tie.
- Rows may have their own step budget (`max_denoising_steps`) and stopping rule; a row that
  stopped denoising is frozen (no decode result used, no random draws) until the canvas commits;
  with `compact_rows` (the default) the decoder pass leaves frozen rows out altogether.
- Host reads: a step reads every row's stop flag in one transfer and every streaming row's draft in one more,
  not one per row (on a GPU each read waits for the device to drain its queue).
- `fuse_commit=True` (`blockpress serve --fuse-commit`): at a boundary where nobody waits to join,
  the committed canvas is encoded in the same pass as the next canvas's first denoising step
  (`encode_decode`: one read of the weights for both). A request that arrives during that boundary
  joins at the next one. Same tokens as the unfused loop up to fp32 summation order.
- `sampler="fast"` (`serve --sampler fast`): each row's sampler arithmetic in one pass over its logits (the fused
  Gumbel-max sampler of `kernels/sampler_fused.py`, seeded from the row's generator) instead of the reference's
  several; reproducible per seed, but not the reference's random stream. A request served alone gets
  `generate(sampler="fast")`'s tokens.
- CUDA graphs (`blockpress serve --cuda-graphs`: `GraphedPasses` installed on the module): a graph reads the
  cache at the addresses it was captured on, so the group's cache lives in *slots*: one set of buffers of
  R rows x P positions (R and P powers of two, grown by doubling when a request needs more; just what is
  needed where doubling would not fit in the GPU's free memory), and a group of
  B rows is their first B rows, a view that starts at the same address for every B. Rows that finish are
  moved down (the kept rows' K/V copied into the lowest slots), joining rows are prefilled (eagerly: a
  prompt's length varies) straight into the slots after them, so the graphs of every batch size stay valid
  and a server in steady state only replays. Row compaction swaps the rows still denoising into the lowest
  slots, and the pass runs that prefix (the graph of its batch size).

Shape legend: B rows in the group, S prompt length, C canvas length, V vocab.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import GenerationConfig
from ..engine.cache import KVCache, front_order
from ..engine.generate import clamp
from ..errors import InputError
from ..kernels.graphs import installed
from ..kernels.sampler_fused import fused_sample
from ..sampling import (StabilityTracker, entropy_bound_accept, sample_tokens, temperature, token_entropy,
                        uniform_tokens)


class QueueFull(Exception):
    """The waiting queue is at capacity."""


@dataclass
class Job:
    """One generation request: the prompt ids and its resolved sampling parameters."""

    prompt_ids: list[int]
    cfg: GenerationConfig
    seed: int | None = None
    drafts: bool = False
    fixed_tokens: list[int] | None = None  # insert mode: new tokens held at these ids (-1 free, -2 free+discarded)


@dataclass
class RowDraft:
    canvas: int
    step: int
    max_steps: int
    tokens: list[int]
    accepted: list[bool]


@dataclass
class RowCommit:
    canvas: int
    tokens: list[int]  # committed canvas, pad after the first stop id
    finished: bool
    steps: int


@dataclass
class RowDone:
    prompt_tokens: int
    steps_per_canvas: list[int]
    forward_passes: int
    queue_seconds: float
    first_commit_seconds: float
    total_seconds: float


@dataclass
class RowError:
    message: str


class Handle:
    """The channel between the scheduler thread and one request's consumer.

    With an asyncio `loop`, events are delivered into an asyncio.Queue (read with `await aget()`);
    without one, into a thread-safe queue (read with `get()`).
    """

    def __init__(self, job: Job, loop=None):
        self.job = job
        self.loop = loop
        self.cancelled = False
        self.submitted = time.perf_counter()
        if loop is not None:
            import asyncio

            self._q = asyncio.Queue()
        else:
            self._q = queue.Queue()

    def put(self, event) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._q.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.cancelled = True
        else:
            self._q.put(event)

    def cancel(self) -> None:
        """Free the slot: the row is dropped at the next step (waiting) or canvas boundary."""
        self.cancelled = True

    def get(self, timeout: float | None = None):
        return self._q.get(timeout=timeout)

    def drain(self) -> list:
        """The events delivered so far, without waiting (a thread-safe queue only: no asyncio `loop`)."""
        events = []
        while True:
            try:
                events.append(self._q.get_nowait())
            except queue.Empty:
                return events

    async def aget(self):
        return await self._q.get()


@dataclass
class _Row:
    handle: Handle
    generator: torch.Generator
    cfg: GenerationConfig
    canvases_left: int
    tracker: StabilityTracker | None
    eos: torch.Tensor | None
    started: float = field(default_factory=time.perf_counter)
    n: int = 0  # remaining denoising steps in the current canvas (N..1), 0 = stopped
    steps: int = 0
    passes: int = 0
    steps_per_canvas: list[int] = field(default_factory=list)
    first_commit: float = 0.0
    finished: bool = False
    fixed: torch.Tensor | None = None  # [canvases * C] ids, -1 = free (Job.fixed_tokens, padded)

    def fixed_for(self, canvas: int, C: int):
        """((mask [1,C], ids [1,C]) held in this canvas, or None; watch [1,C] for stopping, or None)."""
        if self.fixed is None:
            return None, None
        cols = self.fixed[canvas * C:(canvas + 1) * C][None]
        return ((cols >= 0, cols.clamp(min=0)) if bool((cols >= 0).any()) else None,
                cols == -1 if bool((cols != -1).any()) else None)


def _spare_bytes(device) -> int | None:
    """Memory a new allocation on `device` can take (CUDA: free, plus what the caching allocator holds unused), or
    None where that is not known."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class Scheduler:
    """Owns `module` on a background thread; `submit(job)` returns a `Handle` streaming row events."""

    def __init__(self, module, canvas_length: int, max_batch: int = 8, queue_size: int = 64,
                 max_padding: int | None = None, metrics=None, fuse_commit: bool = False, compact_rows: bool = True,
                 sampler: str = "exact"):
        if sampler not in ("exact", "fast"):
            raise InputError(f"unknown sampler {sampler!r}; use 'exact' or 'fast'")
        self.module = module
        self.C = canvas_length
        self.V = module.text.vocab_size
        self.max_positions = module.text.max_position_embeddings
        self.max_batch = max_batch
        self.queue_size = queue_size
        self.max_padding = 4 * canvas_length if max_padding is None else max_padding
        self.metrics = metrics
        self.fuse_commit = fuse_commit
        self.compact_rows = compact_rows
        self.sampler = sampler
        self._waiting: deque[Handle] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.rows: list[_Row] = []
        self.cache: KVCache | None = None
        self._committed: torch.Tensor | None = None  # [B, C] last committed canvas, not yet encoded
        self._admitting: list[Handle] = []  # taken from the queue, not yet rows (failed together on error)
        self.graphs = installed(module)  # CUDA graphs: the group's cache is rows [0, B) of `_slots`
        self._slots: KVCache | None = None

    # ------------------------------------------------------------------ public API
    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="blockpress-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, job: Job, loop=None) -> Handle:
        """Queue a job; raises QueueFull, or InputError when the prompt can never fit the positions."""
        need = len(job.prompt_ids) + math.ceil(job.cfg.max_new_tokens / self.C) * self.C
        if need > self.max_positions:
            raise InputError(f"prompt ({len(job.prompt_ids)} tokens) + generated canvases need {need} positions; "
                             f"the model has {self.max_positions}: shorten the prompt or lower max_tokens")
        handle = Handle(job, loop)
        with self._cond:
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting)")
            self._waiting.append(handle)
            self._gauge()
            self._cond.notify_all()
        return handle

    def warm_up(self) -> float:
        """Run short requests through the loop before `start()`: on a GPU, Triton compiles and checks its kernels
        and CUDA graphs capture their passes here instead of inside the first clients' requests. One request of
        two canvases of two steps (a fused commit runs too); then, under CUDA graphs, `max_batch` requests of
        2..max_batch+1 canvases and 1..max_batch steps, so that each batch size runs a denoising step, a commit
        and (with `fuse_commit`) a fused commit: every graph the server replays is captured before it listens.
        That second part is left out where slots for it would not fit in the GPU's spare memory. Returns the
        seconds it took."""
        if self._thread is not None:
            raise RuntimeError("warm_up() runs before start(): it drives the loop on the calling thread")
        t0 = time.perf_counter()
        self._warm([(2, 2)])
        M = min(self.max_batch, self.queue_size)
        if self.graphs is not None and M > 1:
            need = 8 + (M + 1) * self.C
            cap = min(1 << (need - 1).bit_length(), self.max_positions)  # what `_slot_rows` will allocate
            spare = _spare_bytes(self.module.device)
            if need <= self.max_positions and (spare is None or self._slot_bytes(M, cap) <= spare // 2):
                plan = [(i + 2, i + 1) for i in range(M)]  # (canvases, steps): rows stop, then leave, one by one
                fuse = self.fuse_commit
                try:
                    self.fuse_commit = False  # plain commits (what a boundary with a request joining runs)
                    self._warm(plan)
                    if fuse:
                        self.fuse_commit = True
                        self._warm(plan)
                finally:
                    self.fuse_commit = fuse
        return time.perf_counter() - t0

    def _warm(self, plan: list[tuple[int, int]]) -> None:
        """Submit one 8-token request per (canvases, fixed steps) and run the loop until they are done."""
        ids = [min(5 + i, self.V - 1) for i in range(8)]
        handles = []
        for canvases, steps in plan:
            cfg = GenerationConfig.resolve(max_new_tokens=canvases * self.C, max_denoising_steps=steps,
                                           stability_threshold=None, confidence_threshold=None, eos_token_id=None,
                                           pad_token_id=None)
            handles.append(self.submit(Job(ids, cfg, seed=0)))
        with torch.no_grad():
            while self.rows or self._waiting:
                self._canvas()
        for h in handles:
            for e in h.drain():
                if isinstance(e, RowError):
                    raise RuntimeError(f"warm-up failed: {e.message}")

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ the loop
    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.active_requests.set(len(self.rows))

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.rows and not self._waiting:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
            try:
                with torch.no_grad():
                    self._canvas()
            except Exception as e:  # never let one bad batch kill the server: fail its rows
                for h in [r.handle for r in self.rows] + self._admitting:
                    h.put(RowError(f"generation failed ({type(e).__name__}: {e})"))
                self.rows, self.cache, self._committed, self._admitting = [], None, None, []
                self._gauge()
        for row in self.rows:
            row.handle.put(RowError("server is shutting down"))
        with self._cond:
            for h in self._waiting:
                h.put(RowError("server is shutting down"))
            self._waiting.clear()

    def _canvas(self) -> None:
        """One canvas boundary plus one denoised canvas for every row."""
        self._drop_finished()
        pending = None  # a committed canvas to encode inside the first denoising pass
        if self.rows:  # continuing rows: encode their committed canvas
            with self._cond:
                fuse = self.fuse_commit and not self._waiting
            if fuse:  # nobody to admit: no prompt has to be encoded between the commit and the step
                pending = self._committed
            else:
                self.module.encode(self._committed, self.cache, output=False)
                self._admit()
        else:
            self._admit()
        if not self.rows:
            return
        self._denoise(pending)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.rows) if not (r.finished or r.handle.cancelled)]
        if self.metrics is not None:
            for r in self.rows:
                if r.handle.cancelled and not r.finished:
                    self.metrics.cancelled.inc()
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self._committed = [], None, None
        else:
            if self.graphs is not None:
                self._keep_slots(keep)
            else:
                self.cache.select_rows(keep)
            self._committed = self._committed[keep]
            self.rows = [self.rows[i] for i in keep]
        self._gauge()

    def _select(self) -> list[Handle]:
        """Waiting requests that can join now (FIFO, skipping ones that do not fit yet)."""
        running = self.cache.length if self.rows else None
        lo = hi = running
        chosen: list[Handle] = []
        with self._cond:
            for h in list(self._waiting):
                if h.cancelled:
                    self._waiting.remove(h)
                    if self.metrics is not None:
                        self.metrics.cancelled.inc()
                    continue
                if len(self.rows) + len(chosen) >= self.max_batch:
                    break
                S = len(h.job.prompt_ids)
                canvases = math.ceil(h.job.cfg.max_new_tokens / self.C)
                if running is not None:  # join a running group: end where its cache ends
                    ok = S <= running and running - S <= self.max_padding
                    end = running
                else:  # a fresh group: everyone is left-padded to the longest prompt
                    end = max(hi or 0, S)
                    ok = end - min(lo if lo is not None else S, S) <= self.max_padding
                ok = ok and end + canvases * self.C <= self.max_positions and \
                    all(end + math.ceil(c.job.cfg.max_new_tokens / self.C) * self.C <= self.max_positions
                        for c in chosen)
                if ok:
                    self._waiting.remove(h)
                    chosen.append(h)
                    if running is None:
                        lo, hi = min(lo if lo is not None else S, S), end
        return chosen

    def _admit(self) -> None:
        admitted = self._admitting = self._select()
        if not admitted:
            return
        dev = self.module.device
        S = max(len(h.job.prompt_ids) for h in admitted)
        fresh = not self.rows
        E = S if fresh else self.cache.length
        B = len(admitted)
        ids = torch.zeros(B, S, dtype=torch.long, device=dev)
        mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
        for i, h in enumerate(admitted):  # left padding
            p = h.job.prompt_ids
            ids[i, S - len(p):] = torch.tensor(p, dtype=torch.long, device=dev)
            mask[i, S - len(p):] = True
        horizon = max(math.ceil(h.job.cfg.max_new_tokens / self.C) for h in admitted)
        if self.graphs is not None:  # the rows after the group's in the slots; the prefill is not captured
            new, encode = self._slot_rows(B, E + horizon * self.C), self.graphs.eager("encode")
        else:
            new, encode = self.module.new_cache(B, E + horizon * self.C), self.module.encode
        new.length = E - S  # positions [E - S, E); everything before is padding for these rows
        new.valid[:, :E - S] = False
        new.has_padding = E > S
        encode(ids, new, pad_mask=None if bool(mask.all()) else mask, output=False)
        rows = []
        for h in admitted:
            cfg = h.job.cfg
            g = torch.Generator(device=dev)
            if h.job.seed is not None:
                g.manual_seed(h.job.seed)
            else:
                g.seed()
            tracker = StabilityTracker(cfg.stability_threshold, cfg.confidence_threshold,
                                       cfg.max_denoising_steps) if cfg.adaptive else None
            eos = torch.tensor(cfg.eos_token_id, device=dev) if cfg.eos_token_id else None
            n_canvases = math.ceil(cfg.max_new_tokens / self.C)
            fixed = None
            if h.job.fixed_tokens is not None:
                given = h.job.fixed_tokens[:n_canvases * self.C]
                fixed = torch.full((n_canvases * self.C,), -1, dtype=torch.long, device=dev)
                fixed[:len(given)] = torch.tensor(given, dtype=torch.long, device=dev)
            rows.append(_Row(h, g, cfg, n_canvases, tracker, eos, fixed=fixed))
            if self.metrics is not None:
                self.metrics.queue_seconds.observe(time.perf_counter() - h.submitted)
        if fresh:
            self.cache, self.rows = new, rows
        elif self.graphs is not None:  # the new rows are already in place after the group's
            self.cache = self._group(len(self.rows) + B, E, self.cache.has_padding or new.has_padding)
            self.rows = self.rows + rows
        else:
            self.cache.append_rows(new)
            self.rows = self.rows + rows
        self._admitting = []
        self._gauge()

    # ------------------------------------------------------------------ slots (CUDA graphs)
    def _group(self, n: int, length: int, has_padding: bool) -> KVCache:
        view = self._slots.view_rows(0, n)
        view.length, view.has_padding = length, has_padding
        return view

    def _slot_rows(self, n: int, needed: int) -> KVCache:
        """Slots for n joining rows after the group's, with room for `needed` positions (the slots are regrown,
        the group's rows copied, when they lack either): an empty cache on them, every position valid."""
        have = len(self.rows)
        slots = self._slots
        if not have and slots is not None:  # a fresh group: what earlier groups wrote on the slots is no one's
            slots.forget_writes()
        if slots is None or slots.batch < have + n or slots.capacity < needed:
            least = (max(have + n, slots.batch if slots is not None else 0),
                     max(needed, slots.capacity if slots is not None else 0))
            rows = max(least[0], min(self.max_batch, 1 << (have + n - 1).bit_length()))
            cap = max(least[1], min(1 << (least[1] - 1).bit_length(), self.max_positions))
            spare = _spare_bytes(self.module.device)
            if spare is not None and self._slot_bytes(rows, cap) > spare:  # doubling would not fit: what is needed
                rows, cap = least
            new = self.graphs.eager("new_cache")(rows, cap)
            self.graphs.reserve(rows)  # the graphs' shared logits buffers grow to the slots' rows at once
            if have:  # the group's rows move with their K/V (positions [0, length)) and padding
                new.put_rows(0, self.cache)
            self._slots = new
            if have:
                self.cache = self._group(have, self.cache.length, self.cache.has_padding)
            self.graphs.release(new)  # the graphs captured on the old buffers, and with them the buffers, go
        view = self._slots.view_rows(have, have + n)
        view.valid.fill_(True)  # a previous occupant's padding
        return view

    def _slot_bytes(self, rows: int, capacity: int) -> int:
        """Bytes of slots for rows x capacity positions (K and V of every layer, and the padding mask), and of the
        graphs' shared buffers for as many rows (fp32 logits and self-conditioning logits)."""
        return self.module.cache_bytes(rows, capacity) + rows * self.C * self.V * (4 + self.module.dtype.itemsize)

    def _to_front(self, active: list[int], x, a, sc, fixed, watch):
        """Swap rows so that the `active` ones hold slots [0, n): each frozen row inside that range trades places
        with an active row beyond it (their K/V, padding, canvas, argmax, self-conditioning logits and state).
        Returns fixed and watch in the new order."""
        order = front_order(active, len(self.rows))
        dst = [p for p, o in enumerate(order) if o != p]
        src = [order[p] for p in dst]
        self.cache.move_rows(dst, src)  # a view of the slots: their K/V and padding move
        for t in (x, a, sc):
            t[dst] = t[src]
        self.rows = [self.rows[o] for o in order]
        return [fixed[o] for o in order], [watch[o] for o in order]

    def _keep_slots(self, keep: list[int]) -> None:
        """Move the rows `keep` (ascending) of the group down to slots [0, len(keep))."""
        L, n = self.cache.length, len(keep)
        if keep != list(range(n)):
            self.cache.move_rows(list(range(n)), keep)
        self.cache = self._group(n, L, not bool(self._slots.valid[:n, :L].all()))

    # ------------------------------------------------------------------ denoising
    def _denoise(self, pending: torch.Tensor | None = None) -> None:
        """Denoise one canvas for all rows; per-row sampling with per-row generators. pending [B, C]: the
        committed canvas, encoded into the cache by the first step's pass (`encode_decode`)."""
        m, C, V, dev = self.module, self.C, self.V, self.module.device
        B = len(self.rows)
        x = torch.empty(B, C, dtype=torch.long, device=dev)
        fixed, watch = zip(*[r.fixed_for(len(r.steps_per_canvas), C) for r in self.rows])
        for i, r in enumerate(self.rows):
            x[i] = clamp(uniform_tokens(1, C, V, dev, r.generator), fixed[i])[0]
            r.n, r.steps = r.cfg.max_denoising_steps, 0
            if r.tracker is not None:
                r.tracker.reset()
        a = x.clone()
        sc = None
        sub = None  # row compaction: (active row ids, their cache rows) or, under graphs, (n, rows [0, n) of the
        # slots), rebuilt when a row stops
        t_canvas = time.perf_counter()
        while active := [i for i, r in enumerate(self.rows) if r.n > 0 and not r.handle.cancelled]:
            t0 = time.perf_counter()
            at = range(B)  # row i's logits are raw[at[i]]
            if pending is not None:  # fused: commit + first step in one pass over the weights
                raw = m.encode_decode(pending, x, self.cache)  # [B, C, V] fp32
                pending = None
            elif self.compact_rows and self.graphs is not None and sc is not None and len(active) < B:
                n = len(active)  # graphs: the active rows are swapped into slots [0, n) and the pass runs those
                if active != list(range(n)):
                    fixed, watch = self._to_front(active, x, a, sc, fixed, watch)
                    active = list(range(n))
                if sub is None or sub[0] != n:  # the prefix's cache view, made once per size
                    sub = (n, self._group(n, self.cache.length, self.cache.has_padding))
                raw = m.decode(x[:n], sub[1], sc[:n])
            elif self.compact_rows and sc is not None and len(active) < B:  # frozen rows: no pass
                if sub is None or sub[0] != active:
                    sub = (active, self.cache.rows(torch.tensor(active, device=dev), room=C))
                raw = m.decode(x[active], sub[1], sc[active])  # [len(active), C, V] fp32
                at = dict(zip(active, range(len(active))))
            else:
                raw = m.decode(x, self.cache, sc)  # [B, C, V] fp32
            if sc is None:  # first step; rows written below, frozen rows keep theirs. Graphs: the passes' own input
                sc = raw.to(m.dtype) if self.graphs is None else self.graphs.sc_buffer(B, C).copy_(raw)
            stops, drafts = [], []  # device values read on the host once for all rows, after the loop
            for i in active:
                r = self.rows[i]
                if r.handle.cancelled:  # cancelled during this pass
                    continue
                cfg = r.cfg
                z = raw[at[i]:at[i] + 1]
                tau = None if cfg.t_min is None or cfg.t_max is None else \
                    temperature(r.n, cfg.max_denoising_steps, cfg.t_min, cfg.t_max, dev)
                if self.sampler == "fast":  # one pass over the row's logits; z comes back in the model dtype
                    y, top, h, z = fused_sample(z, tau, r.generator, out_dtype=m.dtype)
                else:  # the reference's arithmetic and draws; z in place (the pass's logits are this step's own)
                    z = z if tau is None else z.div_(tau)
                    y = sample_tokens(z, r.generator)
                    top, h = torch.argmax(z, dim=-1), token_entropy(z)
                a[i] = clamp(top, fixed[i])[0]
                accepted = entropy_bound_accept(h if fixed[i] is None else h.masked_fill(fixed[i][0], 0.0),
                                                cfg.entropy_bound)
                noise = uniform_tokens(1, C, V, dev, r.generator)
                x[i] = clamp(torch.where(accepted, y, noise), fixed[i])[0]
                sc[i] = z[0].to(m.dtype)
                r.steps += 1
                r.passes += 1
                r.n -= 1
                if r.tracker is not None:
                    stops.append((r, r.tracker(a[i:i + 1], z, entropy=h, watch=watch[i])[0]))
                if r.handle.job.drafts:
                    drafts.append((r, torch.stack([a[i], accepted[0].to(a.dtype)])))
            # one host read per step for every row's stop flag, one for every row's draft (a GPU's host waits for
            # the device at each read: one per row would stall the queue B times a step)
            if stops:
                for (r, _), stop in zip(stops, torch.stack([f for _, f in stops]).tolist()):
                    if stop:
                        r.n = 0
            if drafts:
                for (r, _), (top, acc) in zip(drafts, torch.stack([d for _, d in drafts]).tolist()):
                    r.handle.put(RowDraft(len(r.steps_per_canvas), r.steps, r.cfg.max_denoising_steps, top,
                                          [bool(v) for v in acc]))
            if self.metrics is not None:
                self.metrics.step_seconds.observe(time.perf_counter() - t0)
                self.metrics.batch_rows.observe(raw.shape[0])
        if pending is not None:  # every row was cancelled before the first step: the cache still needs it
            m.encode(pending, self.cache, output=False)
        self._commit(a, time.perf_counter() - t_canvas)

    def _commit(self, a: torch.Tensor, seconds: float) -> None:
        now = time.perf_counter()
        for i, r in enumerate(self.rows):
            if r.handle.cancelled:
                continue
            canvas = a[i].clone()
            stop = False
            if r.eos is not None:
                hits = torch.isin(canvas, r.eos).nonzero()
                if hits.numel():
                    stop = True
                    pad = r.cfg.pad_token_id if r.cfg.pad_token_id is not None else 0
                    canvas[int(hits[0]) + 1:] = pad
            r.steps_per_canvas.append(r.steps)
            r.canvases_left -= 1
            r.finished = stop or r.canvases_left == 0
            if len(r.steps_per_canvas) == 1:
                r.first_commit = now - r.started
            r.handle.put(RowCommit(len(r.steps_per_canvas) - 1, canvas.tolist(), r.finished, r.steps))
            if r.finished:
                r.handle.put(RowDone(len(r.handle.job.prompt_ids), r.steps_per_canvas, r.passes,
                                     r.started - r.handle.submitted, r.first_commit, now - r.started))
        if self.metrics is not None:
            self.metrics.canvas_seconds.observe(seconds)
        self._committed = a


def run_job(module, canvas_length: int, job: Job, fuse_commit: bool = False, sampler: str = "exact") -> list[Any]:
    """Run one job synchronously on a private scheduler (tests, CLI): the list of its events."""
    s = Scheduler(module, canvas_length, max_batch=1, queue_size=1, fuse_commit=fuse_commit, sampler=sampler)
    h = s.submit(job)
    events: list[Any] = []
    with torch.no_grad():
        while not events or not isinstance(events[-1], (RowDone, RowError)):
            s._canvas()
            events += h.drain()
    return events

