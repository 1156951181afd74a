"""The server's worker: one thread runs the engine's canvas loop for every request, and hands each request its
own events.

- `submit(job)` gives a request its own random stream (`torch.Generator` seeded with `job.seed`) and queues it
  with the engine's `Scheduler` (bounded: `QueueFull`, a 429); the loop admits it at the next canvas boundary
  (see engine/scheduler.py for who joins when, engine/loop.py for the loop).
- A request's events go to its `Handle`: `RowDraft` after each denoising step it took (when it asked for
  drafts), `RowCommit` per canvas (with its tokens' log-probabilities when the job asked: `Job.logprobs`),
  `RowDone` at the end, or `RowError`. Reproducible: a request's tokens depend
  on its seed, not on its neighbours (for a request served alone they equal
  `generate(generator=torch.Generator().manual_seed(seed))`; in a batch they differ only if float rounding of the
  batched matmuls flips a near-tie).
- Host reads: every streaming row's draft in one read a step, every row's committed canvas in one read a canvas
  (on a GPU each read waits for the device to drain its queue).
- Nothing here denoises: the step, the commit and the passes are the engine's, shared with `generate()`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..config import GenerationConfig, fixed_steps
from ..engine.events import Admitted, Committed, Stepped
from ..engine import prefix
from ..engine.loop import Engine
from ..engine.rows import Job, Row, canvases_for
from ..engine.runner import Runner
from ..engine.scheduler import QueueFull, Scheduler
from ..errors import InputError
from ..model.cache import rounded_capacity
from ..sampling import bias_vector

log = logging.getLogger("blockpress.server")

__all__ = ["Worker", "Job", "Handle", "QueueFull", "ShuttingDown", "RowDraft", "RowCommit", "RowDone", "RowError",
           "run_job"]


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
    tokens: list[int]  # committed canvas, pad after the first stop id where a pad id is set
    finished: bool
    steps: int
    # per position of `tokens` (asked with Job.logprobs = k): (the token's log-probability, [(id, log-probability)
    # of the k most likely tokens, descending]); None when the job did not ask
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cut: bool = False  # the row's grammar closed its output early for max_tokens (engine/constraint.py `cut`)


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
    shutdown: bool = False  # the server is shutting down (a 503), not a failed generation (a 500)


SHUTTING_DOWN = "the server is shutting down; retry on another server, or once it is back"


class ShuttingDown(Exception):
    """The worker takes no more requests: the server is shutting down."""


class Handle:
    """The channel between the worker thread and one request's consumer.

    With an asyncio `loop`, events are delivered into an asyncio.Queue (read with `await aget()`);
    without one, into a thread-safe queue (read with `get()`).
    """

    def __init__(self, job: Job, loop=None):
        self.job = job
        self.loop = loop
        self.row: Row | None = None
        self.cancelled = self.abandoned = False
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
                self.cancel()
        else:
            self._q.put(event)

    def cancel(self, abandoned: bool = True) -> None:
        """Free the slot: the row stops at the next step (waiting: it is dropped) and leaves at the next boundary.
        abandoned: the client went away (counted), rather than its reply being complete (a stop string met)."""
        self.cancelled, self.abandoned = True, abandoned
        if self.row is not None:
            self.row.cancelled = True
            self.row.abandoned = abandoned

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


class Worker:
    """Owns a loaded model (`BlockDiffusionLM`) on a background thread; `submit(job)` returns a `Handle` streaming
    row events.

    It runs as `lm.options` say (under CUDA graphs the rows' cache lives in slots that the graphs of every batch
    size share: engine/runner.py); `overrides` change this worker's engine options only (sampler, fuse_commit,
    compact_rows; every request has its own random stream, so row compaction is on unless turned off)."""

    def __init__(self, lm, max_batch: int = 8, queue_size: int = 64, max_padding: int | None = None,
                 metrics=None, prefix_cache: int = prefix.BUDGET, **overrides):
        """prefix_cache: bytes of prompt K/V kept for later prompts that start the same way (engine/prefix.py;
        0: none)."""
        unknown = sorted(set(overrides) - {"sampler", "fuse_commit", "compact_rows"})
        if unknown:
            raise InputError(f"a worker's own options are sampler, fuse_commit and compact_rows; {unknown[0]} is "
                             "the model's: lm.configure(...)")
        self.options = lm.options.replace(**overrides)
        module = self.module = lm.module
        self.metrics = metrics
        self.C, self.V = module.config.canvas_length, module.text.vocab_size
        self.max_batch, self.queue_size = max_batch, queue_size
        self.scheduler = Scheduler(self.C, module.text.max_position_embeddings, max_batch, queue_size, max_padding)
        compact = self.options.compact_rows is not False
        prefixes = prefix.PrefixCache(prefix_cache) if prefix_cache > 0 else None
        self.runner = Runner(module, lm.passes, slots=True, compact=compact, max_rows=max_batch, prefixes=prefixes)
        self._reused = (0, 0)  # the prefix cache's (hits, tokens reused) the metrics have counted
        self.engine = Engine(self.runner, self.scheduler, self.options.sampler, self.options.fused(lm.device))
        self._cond = threading.Condition()
        self._stop = False
        self._deadline: float | None = None  # set by `drain`: the running rows end by then
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public API
    def start(self) -> "Worker":
        self._thread = threading.Thread(target=self._loop, name="blockpress-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def drain(self, seconds: float) -> None:
        """Begin a shutdown (the server got SIGINT or SIGTERM): no new requests (`ShuttingDown`, a 503), the waiting
        ones ended now, and the running rows given up to `seconds` to finish before they are ended too, at the next
        denoising step, each with a shutdown error its client sees (a stream's error event), so every connection
        closes before the process exits and none is cut without a word. A second call moves the deadline
        (`drain(0)`: the running rows end at the next step)."""
        with self._cond:
            self._deadline = time.monotonic() + seconds
            for row in self.scheduler.clear():
                row.sink.put(RowError(SHUTTING_DOWN, shutdown=True))
            self._gauge()
            self._cond.notify_all()

    def submit(self, job: Job, loop=None) -> Handle:
        """Queue a job; raises QueueFull, InputError when the prompt can never fit the positions, or SamplingError for
        a logit bias of ids outside the vocabulary."""
        return self.submit_together([job], loop)[0]

    def submit_together(self, jobs: list[Job], loop=None) -> list[Handle]:
        """Queue jobs at once, all or none (`submit`'s errors): a request's choices join at the same boundary."""
        handles, rows = [], []
        for job in jobs:
            handle = Handle(job, loop)
            g = torch.Generator(device=self.module.device)
            g.manual_seed(job.seed) if job.seed is not None else g.seed()
            bias = bias_vector(job.logit_bias, self.module.text.vocab_size, self.module.device)
            handle.row = Row(job.cfg, canvases_for(job.cfg.max_new_tokens, self.C), prompt_length=len(job.prompt_ids),
                             generator=g, fixed=self._held(job), constraint=job.constraint, job=job, sink=handle,
                             bias=bias)
            handles.append(handle)
            rows.append(handle.row)
        with self._cond:
            if self._deadline is not None:
                raise ShuttingDown(SHUTTING_DOWN)
            self.scheduler.submit(*rows)
            self._gauge()
            self._cond.notify_all()
        return handles

    def _held(self, job: Job):
        """The job's held tokens over its whole canvases ([n * C] ids on the device, -1 past them), or None."""
        if job.fixed_tokens is None:
            return None
        n = canvases_for(job.cfg.max_new_tokens, self.C) * self.C
        given = job.fixed_tokens[:n]
        return torch.tensor(given + [-1] * (n - len(given)), dtype=torch.long, device=self.module.device)

    @property
    def queue_depth(self) -> int:
        return self.scheduler.depth()

    @property
    def active(self) -> int:
        return len(self.engine.rows)

    @property
    def busy(self) -> bool:
        """Rows in the batch, or waiting to join."""
        return bool(self.engine.rows) or self.scheduler.waiting()

    def warm_up(self) -> float:
        """Run short requests through the loop before `start()`: on a GPU, Triton compiles and checks its kernels
        and CUDA graphs capture their passes here instead of inside the first clients' requests. One request of
        two canvases of two steps (a fused commit runs too); then, under CUDA graphs, `max_batch` requests of
        2..max_batch+1 canvases and as many steps, so that each batch size runs a canvas's first step (a pass
        without self-conditioning logits), a later step, a commit and (with `fuse_commit`) a fused commit: every
        graph the server replays is captured before it listens.
        That second part is left out where slots for it would not fit in the GPU's spare memory. Returns the
        seconds it took."""
        if self._thread is not None:
            raise RuntimeError("warm_up() runs before start(): it drives the loop on the calling thread")
        t0 = time.perf_counter()
        self._warm([(2, 2)])
        M = min(self.max_batch, self.queue_size)
        if self.runner.graphs is not None and M > 1:
            need = 8 + (M + 1) * self.C
            cap = rounded_capacity(need, self.module.text.max_position_embeddings)  # what the slots take
            spare = self.runner.spare()
            if need <= self.module.text.max_position_embeddings and (
                    spare is None or self.runner.slot_bytes(M, cap) <= spare // 2):
                # (canvases, steps): rows stop, then leave, one by one; two steps at least, so that the full batch
                # also runs a step with self-conditioning logits
                plan = [(i + 2, i + 2) for i in range(M)]
                fuse = self.engine.fuse
                try:
                    self.engine.fuse = False  # plain commits (what a boundary with a request joining runs)
                    self._warm(plan)
                    if fuse:
                        self.engine.fuse = True
                        self._warm(plan)
                finally:
                    self.engine.fuse = fuse
        return time.perf_counter() - t0

    def _warm(self, plan: list[tuple[int, int]]) -> None:
        """Submit one 8-token request per (canvases, fixed steps) and run the loop until they are done."""
        ids = [min(5 + i, self.V - 1) for i in range(8)]
        handles = []
        for canvases, steps in plan:
            cfg = GenerationConfig.resolve(max_new_tokens=canvases * self.C, eos_token_id=None, pad_token_id=None,
                                           **fixed_steps(steps))
            handles.append(self.submit(Job(ids, cfg, seed=0)))
        with torch.no_grad():
            while self.busy:
                self.canvas()
        for h in handles:
            for e in h.drain():
                if isinstance(e, RowError):
                    raise RuntimeError(f"warm-up failed: {e.message}")

    # ------------------------------------------------------------------ the loop
    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.queue_depth)
            self.metrics.active_requests.set(self.active)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.busy:
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
            if self._out_of_time():
                continue
            try:
                with torch.no_grad():
                    self.canvas()
            except Exception as e:  # never let one bad batch kill the server: fail its rows
                log.exception("generation failed")
                for row in self.engine.rows + self.engine.admitting:
                    # the exception's text stays in the log: it may quote another request's tokens or grammar
                    row.sink.put(RowError(f"generation failed ({type(e).__name__}); the server's log has the details"))
                self.engine.reset()
                self._gauge()
        for row in self.engine.rows + self.scheduler.clear():
            row.sink.put(RowError(SHUTTING_DOWN, shutdown=True))

    def _out_of_time(self) -> bool:
        """Past a drain's deadline with rows running: end each with a shutdown error, a word to its client (checked
        at every event of a canvas: a canvas of many steps may take longer than the drain gives)."""
        if self._deadline is None or time.monotonic() < self._deadline:
            return False
        rows = self.engine.rows + self.engine.admitting
        if not rows:
            return False
        for row in rows:
            row.sink.put(RowError(SHUTTING_DOWN, shutdown=True))
        self.engine.reset()
        self._gauge()
        return True

    def canvas(self) -> None:
        """One canvas boundary and one denoised canvas for every row, their events delivered (the thread's loop
        body; tests drive it by hand for a deterministic schedule)."""
        t = time.perf_counter()
        events = self.engine.canvas()
        for ev in events:
            if self._out_of_time():
                events.close()  # (the rows are ended and the engine reset: nothing of this canvas is delivered)
                return
            now = time.perf_counter()
            if isinstance(ev, Admitted):
                for row in ev.rows:
                    row.started = now
                    if self.metrics is not None:
                        self.metrics.queue_seconds.observe(now - row.sink.submitted)
                self._count_reuse()
                self._gauge()  # queued -> active now, not at the canvas's end
            elif isinstance(ev, Stepped):
                self._drafts(ev)
                if self.metrics is not None:
                    self.metrics.step_seconds.observe(now - t)
                    self.metrics.batch_rows.observe(self.runner.pass_rows)
            elif isinstance(ev, Committed):
                self._commits(ev, now)
            t = now
        if self.metrics is not None and self.scheduler.dropped:
            self.metrics.cancelled.inc(self.scheduler.dropped)
        self.scheduler.dropped = 0
        self._gauge()

    def _count_reuse(self) -> None:
        """The prefix cache's hits and reused tokens into the metrics (at admission: before any reply goes out)."""
        pc = self.runner.prefixes
        if self.metrics is not None and pc is not None and (pc.hits, pc.tokens_reused) != self._reused:
            self.metrics.prefix_hits.inc(pc.hits - self._reused[0])
            self.metrics.prefix_tokens.inc(pc.tokens_reused - self._reused[1])
            self._reused = (pc.hits, pc.tokens_reused)

    def _drafts(self, ev: Stepped) -> None:
        """Every streaming row's draft, read from the device at once."""
        idx = [i for i, (r, ran) in enumerate(zip(ev.rows, ev.ran)) if ran and r.job.drafts and not r.cancelled]
        if not idx:
            return
        both = torch.stack([torch.stack([ev.tokens[i], ev.accepted[i].to(ev.tokens.dtype)]) for i in idx]).tolist()
        for i, (tokens, accepted) in zip(idx, both):
            r = ev.rows[i]
            r.sink.put(RowDraft(r.canvas, r.steps, r.cfg.max_denoising_steps, tokens, [bool(v) for v in accepted]))

    def _commits(self, ev: Committed, now: float) -> None:
        tokens = ev.tokens.tolist()
        logprobs = self._logprobs(ev)
        for b, (r, canvas, finished) in enumerate(zip(ev.rows, tokens, ev.finished)):
            if r.cancelled:
                continue
            r.sink.put(RowCommit(r.canvas - 1, canvas, finished, r.steps, logprobs.get(b),
                                 bool(getattr(r.constraint, "cut", False))))
            if finished:
                r.sink.put(RowDone(r.prompt_length, r.steps_per_canvas, r.passes, r.started - r.sink.submitted,
                                   r.first_commit, now - r.started))
        if self.metrics is not None:
            self.metrics.canvas_seconds.observe(ev.seconds)

    @staticmethod
    def _logprobs(ev: Committed) -> dict[int, list]:
        """Batch index -> per position (log-probability, [(id, log-probability)] alternatives) for the rows that
        asked: one read for all of them (two with alternatives)."""
        lp = ev.logprobs
        if lp is None:
            return {}
        values = lp.values.tolist()
        ids = lp.ids.tolist() if lp.ids is not None else None
        out = {}
        for n, b in enumerate(lp.rows):
            k = ev.rows[b].job.logprobs
            out[b] = [(v[0], list(zip(ids[n][c][:k], v[1:1 + k])) if ids is not None else [])
                      for c, v in enumerate(values[n])]
        return out


def run_job(lm, job: Job, **overrides) -> list[Any]:
    """Run one job synchronously on a private worker (tests, CLI): the list of its events."""
    w = Worker(lm, max_batch=1, queue_size=1, **overrides)
    h = w.submit(job)
    events: list[Any] = []
    with torch.no_grad():
        while not events or not isinstance(events[-1], (RowDone, RowError)):
            w.canvas()
            events += h.drain()
    return events
