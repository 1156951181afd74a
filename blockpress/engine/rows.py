"""A row of the batch: one sequence being generated, with its settings, random stream and counters.

`Job` is what a caller asks for (prompt ids, sampling settings, seed, held tokens); `Row` is the engine's state
for it while it is in the batch. Plain Python (torch objects ride along opaquely): the scheduler reads rows
without importing torch.

Invariants:
- `left` counts the denoising steps this row may still take in the current canvas (its
  `max_denoising_steps` at the canvas start); a row with none left, cancelled, or stopped by its stopping
  rule is frozen until the commit.
- `generator` is the row's own random stream, or None where the batch draws from one shared stream (the
  reference's draw order for a Python batch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One generation request: the prompt ids and its resolved sampling parameters."""

    prompt_ids: list[int]
    cfg: Any  # config.GenerationConfig
    seed: int | None = None
    drafts: bool = False
    fixed_tokens: list[int] | None = None  # new tokens held at these ids (-1 free, -2 free+discarded)
    constraint: Any = None  # engine.constraint.Constraint: the grammar its output obeys (one per job), or None
    logprobs: int | None = None  # committed tokens' log-probabilities with this many alternatives (None: not asked)
    logit_bias: dict[int, float] | None = None  # added to its logits every step (sampling.bias_vector), or None


@dataclass
class Row:
    cfg: Any  # config.GenerationConfig
    n_canvases: int
    index: int = 0  # the caller's row index (a Python batch) or submission order
    prompt_length: int = 0
    generator: Any = None  # torch.Generator of this row, or None: the batch's shared stream
    fixed: Any = None  # [n_canvases * C] device ids held per canvas (-1 free, -2 free and discarded), or None
    constraint: Any = None  # engine.constraint.Constraint: the grammar its canvases obey, or None
    bias: Any = None  # [V] fp32 device vector added to its logits every step (sampling.bias_vector), or None
    job: Job | None = None
    sink: Any = None  # who hears this row's events (the server's Handle)
    cancelled: bool = False
    abandoned: bool = False  # cancelled because its client went away (not because its reply was complete)
    finished: bool = False
    canvas: int = 0  # canvases committed
    steps: int = 0  # denoising steps taken in the current canvas
    left: int = 0  # denoising steps left in the current canvas
    passes: int = 0  # decoder passes this row was counted in (not while frozen or finished)
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not encoded)
    cache_write_tokens: int = 0  # prompt tokens this row's prefill put in the prefix cache
    steps_per_canvas: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_commit: float = 0.0

    @property
    def canvases_left(self) -> int:
        return self.n_canvases - self.canvas

    def start_canvas(self) -> None:
        self.steps, self.left = 0, self.cfg.max_denoising_steps


def canvases_for(max_new_tokens: int, canvas_length: int) -> int:
    return math.ceil(max_new_tokens / canvas_length)


def positions_needed(prompt_length: int, max_new_tokens: int, canvas_length: int) -> int:
    """Positions a row occupies once every canvas it may write is committed (whole canvases)."""
    return prompt_length + canvases_for(max_new_tokens, canvas_length) * canvas_length
