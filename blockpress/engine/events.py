"""What the canvas loop reports: the public events of `stream()` and the result of `generate()`.

Shape legend: B batch, S prompt length, C canvas length.

Events hold host (CPU) tensors, copies that later steps never write to. `Stepped` and `Committed` are the
engine's own events, in batch order with device tensors: each consumer (Python's `stream`, the server's worker)
reads what it needs of them, so a step reads nothing back that nobody asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..model.cache import KVCache


@dataclass
class Draft:
    """After every denoising step: the current argmax canvas and which positions were accepted."""

    canvas_index: int
    step: int  # 1-based count of executed steps in this canvas
    max_steps: int
    tokens: torch.Tensor  # [B, C] argmax canvas (cpu)
    accepted: torch.Tensor  # [B, C] bool, positions kept by entropy-bound acceptance this step (cpu)
    done: torch.Tensor  # [B] bool, rows that stopped denoising


@dataclass
class Commit:
    """After every canvas: the committed (EOS/pad-finalised) tokens."""

    canvas_index: int
    tokens: torch.Tensor  # [B, C] (cpu)
    finished: torch.Tensor  # [B] bool, rows whose sequence has ended
    steps: int  # denoising steps executed for this canvas
    seconds: float  # wall time of this canvas (encoder pass included)


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [B, S + n_canvases * C]
    tokens_per_forward: torch.Tensor  # [B] float
    steps_per_canvas: list[int]
    canvas_seconds: list[float]
    prompt_length: int
    prefill_seconds: float
    first_commit_seconds: float
    total_seconds: float
    forward_passes: torch.Tensor  # [B] decoder passes counted per row
    cache: KVCache | None = field(default=None, repr=False)
    config: GenerationConfig | None = field(default=None, repr=False)  # the GenerationConfig it ran with (its stop ids and token limit)

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length:]


@dataclass
class Finished:
    result: GenerationResult


# ------------------------------------------------------------------------------------------ the engine's own


@dataclass
class Admitted:
    """Rows joined the batch at this boundary (their prompts are in the cache)."""

    rows: list  # engine.rows.Row, the joiners


@dataclass
class Stepped:
    """After a denoising step, in batch order: `ran` the rows this step denoised (not frozen)."""

    rows: list  # the batch's Rows, in batch order
    step: int  # executed steps in this canvas
    tokens: torch.Tensor  # [B, C] argmax canvas (device)
    accepted: torch.Tensor  # [B, C] bool (device); False on rows that did not run
    done: torch.Tensor  # [B] bool (device): rows that stopped denoising
    ran: list[bool]


@dataclass
class TokenLogprobs:
    """Log-probabilities of a canvas's committed tokens, for the rows that asked (`Job.logprobs`), under the
    distribution of the denoising step that produced the committed canvas: log_softmax of that step's
    (temperature-scaled) logits, the self-conditioning logits `Canvas.sc` (in the model's dtype).

    rows: batch indices of the rows that asked; values [n, C, 1 + K] fp32 (device): the committed token's
    log-probability, then the K most likely tokens' in descending order (K the largest any of them asked for; a
    row reads its own first k); ids [n, C, K] (device) the ids of those K, or None when K is 0."""

    rows: list[int]
    values: torch.Tensor
    ids: torch.Tensor | None


@dataclass
class Committed:
    """After a canvas, in batch order: the committed tokens (EOS/pad rule applied) and which rows ended; the
    committed tokens' log-probabilities where a row asked for them (None: nobody did)."""

    rows: list
    tokens: torch.Tensor  # [B, C] (device)
    finished: list[bool]
    steps: int  # steps the batch executed in this canvas
    seconds: float
    logprobs: TokenLogprobs | None = None
