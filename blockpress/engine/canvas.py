"""The canvas being denoised, for every row of the batch, and the rules its rows denoise by.

Shape legend: B rows, C canvas length, V vocab.

A `Canvas` holds, in batch order: the input `x` and argmax `a` [B, C], the self-conditioning logits `sc`
[B, C, V] (None before the first step), which rows are `done` (on the device and on the host), the held tokens
of an infilling canvas and the positions stopping looks at, the rows' stopping rule and entropy bound, and the
batch's random stream. The rules come from each row's settings: one for the batch where the rows agree (a Python
batch), else one per row (the server's requests), which compute row for row the same numbers.
"""

from __future__ import annotations

import torch

from ..sampling import StabilityTracker, temperature


def clamp(tokens: torch.Tensor, fixed) -> torch.Tensor:
    """tokens [B,C] with the held positions (mask, ids) written in."""
    return tokens if fixed is None else torch.where(fixed[0], fixed[1], tokens)


class Canvas:
    """The canvas being denoised, for every row of the batch (batch order): argmax `a` and input `x` [B, C],
    self-conditioning logits `sc` [B, C, V] (None before the first step), `done` [B] on the device and
    `done_host` on the host, held tokens `fixed` (mask, ids) and stopping's `watch` [B, C] (or None), the rows'
    stopping rule `tracker`, entropy `bound` (a float, or [B, 1] per row), the batch's random stream
    `shared` (None: per-row generators) and the rows' logit `bias` [B, 1, V] (zeros for a row without one; None
    where no row has one)."""

    def __init__(self, rows, x, sc, fixed, watch, tracker, bound, shared, per_row: bool):
        self.rows, self.x, self.a, self.sc = rows, x, x, sc
        self.done = torch.zeros(len(rows), dtype=torch.bool, device=x.device)
        self.done_host = [False] * len(rows)
        self.fixed, self.watch, self.tracker, self.bound = fixed, watch, tracker, bound
        self.shared, self.per_row = shared, per_row
        self.bias = logit_bias(rows)
        self.steps = 0

    def generators(self, idx=None):
        """The random stream of these rows: the shared generator (or None: torch's global one), or their own."""
        if not self.per_row:
            return self.shared
        rows = self.rows if idx is None else [self.rows[i] for i in idx]
        return [r.generator for r in rows]

    def taus(self, idx) -> list | None:
        """Each row's temperature at this step as a 0-dim fp32 device tensor (None: no schedule), or None when no
        row has a schedule; rows with the same schedule and step share one tensor. A tau is a view into its
        schedule, made on the device once (no host-to-device copy per step)."""
        keys = []
        for i in idx:
            cfg = self.rows[i].cfg
            keys.append(None if cfg.t_min is None or cfg.t_max is None else
                        (self.rows[i].left, cfg.max_denoising_steps, cfg.t_min, cfg.t_max))
        if all(k is None for k in keys):
            return None
        made: dict = {}
        for k in keys:
            if k is not None and k not in made:
                made[k] = temperature(*k, self.x.device)
        return [None if k is None else made[k] for k in keys]

    def permute(self, order: list[int]) -> torch.Tensor:
        """Rows reordered: row s takes row order[s] (their tensors, host state and Row objects). Returns the index."""
        idx = torch.tensor(order, device=self.x.device)
        self.rows[:] = [self.rows[o] for o in order]
        self.x, self.a, self.done = self.x[idx], self.a[idx], self.done[idx]
        self.done_host = [self.done_host[o] for o in order]
        self.fixed = None if self.fixed is None else (self.fixed[0][idx], self.fixed[1][idx])
        self.watch = None if self.watch is None else self.watch[idx]
        if isinstance(self.bound, torch.Tensor):
            self.bound = self.bound[idx]
        if self.bias is not None:
            self.bias = self.bias[idx]
        if self.tracker is not None:
            self.tracker.permute(idx, order)
        return idx


def _same(values: list) -> bool:
    return all(v == values[0] for v in values)


def stopping_rule(rows) -> StabilityTracker | None:
    """The rows' stopping rule: one for the batch where they agree, else one per row (None: no row stops early)."""
    cfgs = [r.cfg for r in rows]
    if not any(c.adaptive for c in cfgs):
        return None
    keys = [(c.stability_threshold, c.confidence_threshold, c.max_denoising_steps) if c.adaptive else None
            for c in cfgs]
    if _same(keys):
        return StabilityTracker(*keys[0])
    return StabilityTracker([k and k[0] for k in keys], [k and k[1] for k in keys], [k and k[2] for k in keys])


def entropy_bound(rows, device):
    """The entropy bound: a float where the rows agree, else [B, 1] fp32 (the dtype a float is compared in)."""
    bounds = [r.cfg.entropy_bound for r in rows]
    return bounds[0] if _same(bounds) else torch.tensor(bounds, dtype=torch.float32, device=device)[:, None]


def logit_bias(rows) -> torch.Tensor | None:
    """The rows' logit biases [B, 1, V] (a row without one adds zeros: the same bits), or None where no row has one."""
    biased = [r.bias for r in rows if r.bias is not None]
    if not biased:
        return None
    zeros = torch.zeros_like(biased[0]) if len(biased) < len(rows) else None
    return torch.stack([zeros if r.bias is None else r.bias for r in rows])[:, None]


def held_tokens(rows, C: int, device):
    """The tokens each row holds on its current canvas: (fixed (mask, ids) [B, C] or None, watch [B, C] or None:
    the positions stopping looks at, where some are free but discarded)."""
    if all(r.fixed is None for r in rows):
        return None, None
    free = torch.full((C,), -1, dtype=torch.long, device=device)
    cols = torch.stack([free if r.fixed is None else r.fixed[r.canvas * C:(r.canvas + 1) * C] for r in rows])
    fixed = (cols >= 0, cols.clamp(min=0)) if bool((cols >= 0).any()) else None
    watch = cols == -1 if bool((cols != -1).any()) else None  # stopping looks at what the model decides and keeps
    return fixed, watch
