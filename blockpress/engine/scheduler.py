"""Which rows join the batch and which leave it, at canvas boundaries: plain Python, no torch.

Continuous batching at canvas granularity:
- Requests wait in a bounded queue (`QueueFull` when it is full: a server answers 429).
- The batch's rows share one KV cache whose length (E, the encoded positions) is the same for every row. A
  joining prompt of S tokens is left-padded so that it ends where the batch's cache ends: it is encoded at
  positions [E - S, E) (the positions before it are masked, never computed). Attention depends on
  position differences only (RoPE), so a padded row computes what it would compute alone (up to rounding). It
  joins when S <= E, however long the batch has run: a short request that arrives while a long one writes its
  tenth canvas joins at the next boundary (it waited for the whole batch to drain while the padding was bounded,
  14 s behind a long reply on the shipped chat model). A longer prompt waits (E grows by a canvas per boundary;
  when the batch drains, a fresh one starts).
- The positions before every running row's prompt are kept for no one, so a joiner may not find more of them than
  its own prompt plus `max_padding`: its padding E - S is at most the longest running row's own span (its prompt
  and committed canvases) plus `max_padding`. A short request behind a long prompt or a long reply joins; under
  steady short traffic, where each row joined at the end of the last one's cache, joins stop once E has run that
  far ahead of every row's own span, the batch drains within its rows' last canvases, and a fresh one starts at
  its longest prompt. Without that bound E climbed by a canvas per boundary to the model's position limit,
  whatever the requests' lengths (a 40-token chat reached 3,800 positions a row on the shipped chat model; the
  26B model's 262,144 would be ~6 GB a row), and a longer prompt waited for E to reach it.
- The prompts that join at one boundary are encoded together, left-padded to the longest of them, and that
  padding is computed: they join together while the longest minus the shortest is at most `max_padding` (the
  others join at a later boundary). A fresh batch (after the last one drained) ends at its longest prompt.
- The rows queued by one `submit` (a request's `n` choices, a completions batch) join at the same boundary, all or
  none (in parts of `max_batch` rows where there are more).
- First come, first served, skipping requests whose prompts do not fit yet; at most `max_batch` rows: a request
  that waits for room in the batch is not overtaken by later ones.
- Rows leave at a boundary once finished or cancelled; a waiting request that was cancelled is dropped at once,
  wherever it waits (it does not hold a place in the queue).

Rows are `engine.rows.Row` (anything with `prompt_length`, `cfg.max_new_tokens`, `cancelled` and `finished`
does). `submit` may be called from other threads than the one running the loop (a lock guards the queue).

The engine's loop asks its *source* three things at a boundary: `keep(rows)` (who stays; None: everyone),
`waiting()` (does anyone wait to join) and `admit(rows, length)` (an `Admission`, or None). `Scheduler` is the
source of a server; a Python batch is a source that admits its rows once.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .rows import positions_needed


class QueueFull(Exception):
    """The waiting queue is at capacity."""


class TooManyRows(InputError):
    """One submit's rows are more than the queue ever holds."""


@dataclass
class Admission:
    """Rows that join at a boundary, their prompts ending at position `end`. ids / mask ([B, S] tensors): the
    prompts already left-padded (a Python batch's own); None: the engine pads `row.job.prompt_ids` with zeros.
    cache: a cache to continue (a Python batch's, multi-turn)."""

    rows: list
    end: int
    ids: Any = None
    mask: Any = None
    cache: Any = None


class Scheduler:
    def __init__(self, canvas_length: int, max_positions: int, max_batch: int = 8, queue_size: int = 64,
                 max_padding: int | None = None):
        self.C, self.max_positions = canvas_length, max_positions
        self.max_batch, self.queue_size = max_batch, queue_size
        self.max_padding = 4 * canvas_length if max_padding is None else max_padding
        self.queue: deque = deque()  # of groups: the rows of one `submit` (or a part of max_batch of them), in order
        self.dropped = 0  # requests abandoned by their clients, waiting or in the batch (a server counts them)
        self.lock = threading.Lock()

    def _need(self, row, end: int) -> int:
        return end - row.prompt_length + positions_needed(row.prompt_length, row.cfg.max_new_tokens, self.C)

    def submit(self, *rows) -> None:
        """Queue rows at once, all or none (the choices of one request: they join at the same boundary); QueueFull
        when the queue has no room for all now, InputError when a prompt can never fit the positions or the rows
        are more than the queue holds."""
        for row in rows:
            need = positions_needed(row.prompt_length, row.cfg.max_new_tokens, self.C)
            if need > self.max_positions:
                raise InputError(f"prompt ({row.prompt_length} tokens) + generated canvases need {need} positions; "
                                 f"the model has {self.max_positions}: shorten the prompt or lower max_tokens")
        if len(rows) > self.queue_size:  # no wait would ever make room: not a 429 to retry
            raise TooManyRows(f"this request needs {len(rows)} rows (its prompts times n), more than the server's "
                              f"queue ever holds ({self.queue_size}, --queue-size); send fewer prompts or a lower n")
        with self.lock:
            waiting = self._prune()
            if waiting + len(rows) > self.queue_size:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting)" if len(rows) == 1 else
                                f"the request queue has no room for its {len(rows)} rows ({waiting} of "
                                f"{self.queue_size} waiting)")
            self.queue.extend(tuple(rows[i:i + self.max_batch]) for i in range(0, len(rows), self.max_batch))

    def _prune(self) -> int:
        """Drop the cancelled rows from the queue (under the lock); the number of rows still waiting."""
        n = 0
        for group in list(self.queue):
            live = tuple(r for r in group if not r.cancelled)
            if len(live) < len(group):
                self.dropped += len(group) - len(live)
                if live:
                    self.queue[self.queue.index(group)] = live
                else:
                    self.queue.remove(group)
            n += len(live)
        return n

    def depth(self) -> int:
        """Rows waiting to join (the cancelled ones dropped)."""
        with self.lock:
            return self._prune()

    def waiting(self) -> bool:
        return self.depth() > 0

    def keep(self, running: list) -> list[int]:
        """The rows of the batch that stay at this boundary (not finished, not cancelled), in order."""
        self.dropped += sum(r.cancelled and r.abandoned for r in running)
        return [i for i, r in enumerate(running) if not (r.finished or r.cancelled)]

    def admit(self, running: list, length: int | None) -> Admission:
        """Waiting rows that join now, and the position E their prompts end at (`length`: the batch's cache
        length, None for a fresh batch). They are taken off the queue."""
        with self.lock:
            chosen = self._choose(running, length)
        end = length if length is not None else max((r.prompt_length for r in chosen), default=0)
        return Admission(chosen, end)

    def _choose(self, running: list, length: int | None) -> list:
        self._prune()
        lo = hi = None  # the shortest and longest prompt chosen: they are encoded together, padded to the longest
        chosen: list = []
        # what a joiner's padding may reach: the longest running row's own positions, and max_padding
        reach = max((r.prompt_length + r.canvas * self.C for r in running), default=0) + self.max_padding
        for group in list(self.queue):
            if len(running) + len(chosen) + len(group) > self.max_batch:
                break  # it waits for room, and nothing queued after it goes first
            S = [r.prompt_length for r in group]
            low, high = min(S) if lo is None else min(lo, *S), max(S) if hi is None else max(hi, *S)
            # a running batch: end where its cache ends (the padding before the joiners' prompts is masked only);
            # a fresh batch: at the longest prompt
            end = length if length is not None else high
            ok = max(S) <= end and high - low <= self.max_padding  # (the joiners' own padding is computed)
            ok = ok and (length is None or end - low <= reach)  # (a running batch: the padding kept for no one)
            ok = ok and all(self._need(r, end) <= self.max_positions for r in (*chosen, *group))
            if ok:
                self.queue.remove(group)
                chosen.extend(group)
                lo, hi = low, high
        return chosen

    def clear(self) -> list:
        """Empty the queue (shutting down); returns the rows that waited."""
        with self.lock:
            rows, self.queue = [r for group in self.queue for r in group], deque()
        return rows
