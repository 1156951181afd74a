"""Pure sampler arithmetic of one denoising step.

Shape legend: B batch, C canvas length, V vocab.

All functions are side-effect free except for the random draws, which take an optional
`generator` (None = torch's global generator). The draw order of the reference is:
per canvas `randint[B,C]` (initial canvas), then per step `multinomial` over the flattened
[B*C, V] probabilities followed by `randint[B,C]` (renoise).

`generator` may also be a list with one generator per row: each row then draws from its own
stream (`randint[1,C]`, `multinomial` over its [C,V]), and only while the row is `active`
(neither done denoising nor finished; a [B] bool tensor or a host list), which makes a row's tokens
independent of what else is in the batch (the server batches requests with their own seeds). For B = 1
the two forms consume the stream identically, since an inactive single row ends the loop.

A logit bias (`bias_vector`, OpenAI's `logit_bias`) is added to a row's (soft-capped) logits before the
temperature, every step: it moves the distribution the step draws from, its argmax, entropy and self-conditioning
alike. The logits are soft-capped (|z| < 30 on DiffusionGemma), so -100 bans a token and +100 forces it.

`StabilityTracker` takes one stopping rule for the batch or one per row (the server batches requests
with their own settings); per-row rules compute, row for row, what one rule computes.
"""

from __future__ import annotations

import functools
import math

import torch

from ..errors import CheckpointError, SamplingError

_SCHEDULE_CHUNK = 4096


def temperature(n: int, n_steps: int, t_min: float, t_max: float, device) -> torch.Tensor:
    """tau = t_min + (t_max - t_min) * (n / N) in fp32, n counting down the remaining steps.

    A 0-dim view into `temperature_schedule` (made on the device once per schedule), so a denoising step
    copies nothing from the host: a host-to-device copy would make the host wait for the GPU."""
    chunk, i = divmod(n, _SCHEDULE_CHUNK)
    return temperature_schedule(n_steps, t_min, t_max, torch.device(device), chunk)[i]


@functools.lru_cache(maxsize=256)
def temperature_schedule(n_steps: int, t_min: float, t_max: float, device: torch.device,
                         chunk: int = 0) -> torch.Tensor:
    """fp32 on `device`: entry i is tau for n = chunk * 4096 + i remaining steps, n <= N (the same fp32
    arithmetic as one scalar at a time). Made in chunks of 4096 so that a huge step budget (adaptive
    mode with no practical limit) costs no more memory than the steps it runs. Cached: read-only."""
    lo = chunk * _SCHEDULE_CHUNK
    n_t = torch.arange(lo, min(lo + _SCHEDULE_CHUNK, n_steps + 1),
                       dtype=torch.int32 if n_steps < 2**31 else torch.int64, device=device)
    return t_min + (t_max - t_min) * (n_t / n_steps)


def _rows(generator, active):
    flags = [True] * len(generator) if active is None else active if isinstance(active, list) else active.tolist()
    return list(zip(generator, flags))


def uniform_tokens(batch: int, canvas: int, vocab: int, device, generator=None, active=None) -> torch.Tensor:
    """Uniform noise over the whole vocabulary [0, V) (special ids included)."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.randint(0, vocab, (1, canvas), device=device, generator=g) if on
                          else torch.zeros(1, canvas, dtype=torch.long, device=device)
                          for g, on in _rows(generator, active)])
    return torch.randint(0, vocab, (batch, canvas), device=device, generator=generator)


def bias_vector(logit_bias, vocab_size: int, device) -> torch.Tensor | None:
    """A logit bias {token id: value} as the [V] fp32 vector a step adds to a row's logits; None for None or {}.
    SamplingError names a token id outside [0, V) or a value that is not a finite number."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise SamplingError(f"logit_bias must be a dict {{token id: bias}}, got {type(logit_bias).__name__}")
    if not logit_bias:
        return None
    ids, values = [], []
    for k, v in logit_bias.items():
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < vocab_size:
            raise SamplingError(f"logit_bias: {k!r} is not a token id in [0, {vocab_size}); keys are this model's "
                                "token ids")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SamplingError(f"logit_bias[{k}] = {v!r} is not a finite number; -100 bans a token, +100 forces it")
        ids.append(k)
        values.append(float(v))
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    bias[ids] = torch.tensor(values, dtype=torch.float32)
    return bias.to(device)


def token_entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per position [B, C], with 0 * log 0 = 0 (log-softmax form)."""
    logp = z - z.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(logp, dim=-1)
    if logp.requires_grad or p.requires_grad:
        logp = torch.clamp(logp, min=torch.finfo(logp.dtype).min)
        return -(logp * p).sum(-1)
    # the same ops in place: two [B, C, V] buffers live instead of four (268 MB each on the 26B)
    return -p.mul_(logp.clamp_(min=torch.finfo(logp.dtype).min)).sum(-1)


def entropy_bound_accept(h: torch.Tensor, bound: float) -> torch.Tensor:
    """Accept the lowest-entropy positions while the exclusive prefix sum of entropies <= bound.

    h [B, C] -> bool [B, C]; the lowest-entropy position is always accepted.
    """
    h_sorted, order = torch.sort(h, dim=-1, descending=False)
    cum = torch.cumsum(h_sorted, dim=-1)
    accept_sorted = cum - h_sorted <= bound
    return torch.scatter(torch.zeros_like(accept_sorted), -1, order, accept_sorted)


def sample_tokens(z: torch.Tensor, generator=None, active=None) -> torch.Tensor:
    """One categorical draw per position from softmax(z) (fp32). z [B,C,V] -> [B,C]."""
    B, C, V = z.shape
    probs = torch.softmax(z, dim=-1, dtype=torch.float32)
    try:
        if isinstance(generator, (list, tuple)):
            return torch.stack([torch.multinomial(probs[b], num_samples=1, generator=g).view(C) if on
                                else torch.zeros(C, dtype=torch.long, device=z.device)
                                for b, (g, on) in enumerate(_rows(generator, active))])
        return torch.multinomial(probs.view(-1, V), num_samples=1, generator=generator).view(B, C)
    except RuntimeError as e:  # torch checks the probabilities on the host side of the draw: no cost when they are fine
        if "probability tensor contains" not in str(e):
            raise
        raise CheckpointError("the model's logits are not finite (NaN or inf): in float16 its activations can pass "
                            "that type's range (load it in bfloat16 or float32); else its weights, an adapter's, or a "
                            "config value such as a rotary factor of 0 make them so; check the checkpoint (and "
                            "adapter) with blockpress.load and a plain generate") from None


class StabilityTracker:
    """Stable-and-confident stopping; history reset for every canvas.

    stability_threshold / confidence_threshold: one rule for every row, or a list with one per row (None there: the
    row never stops early, as a row without adaptive stopping). A row is done when its argmax canvas equals each of
    its last S ones (S = 0: always) and its mean entropy is below kappa."""

    def __init__(self, stability_threshold, confidence_threshold, max_steps=None):
        # A canvas takes at most `max_steps` steps, and a row needs S recorded steps before it can be
        # stable, so any S >= max_steps means "never stops early": clamping keeps the history (S canvases
        # of argmaxes) from growing with an arbitrarily large threshold.
        self.per_row = isinstance(stability_threshold, (list, tuple))
        if not self.per_row:
            if max_steps is not None:
                stability_threshold = min(stability_threshold, max_steps)
            self.S, self.kappa = stability_threshold, confidence_threshold
            self._skip = self._enabled = None
        else:
            steps = max_steps if isinstance(max_steps, (list, tuple)) else [max_steps] * len(stability_threshold)
            S = [0 if s is None else s if n is None else min(s, n) for s, n in zip(stability_threshold, steps)]
            self.S = max(S, default=0)
            self._row_S = S
            self._enabled_list = [s is not None for s in stability_threshold]
            self._kappa_list = [0.0 if k is None else float(k) for k in confidence_threshold]
            self.kappa = self._skip = self._enabled = None  # device tensors, made on the first call
        self.history: torch.Tensor | None = None

    def reset(self) -> None:
        self.history = None

    def _row_rules(self, device) -> None:
        """Per-row rules as device tensors, once: kappa [B] fp32 (the dtype one float threshold is compared in),
        which rows stop at all [B], and which history entries a row with a shorter S ignores [S, B]."""
        if self._enabled is not None:
            return
        self.kappa = torch.tensor(self._kappa_list, dtype=torch.float32, device=device)
        self._enabled = torch.tensor(self._enabled_list, dtype=torch.bool, device=device)
        if any(s != self.S for s in self._row_S):
            first = torch.tensor([self.S - s for s in self._row_S], device=device)  # [B]
            self._skip = torch.arange(self.S, device=device)[:, None] < first[None, :]

    def stable(self, argmax: torch.Tensor, watch: torch.Tensor | None = None) -> torch.Tensor:
        """[B] True where the argmax equals each of the last S argmax canvases (at the `watch` positions
        [B,C] when given); records this one."""
        if self.S == 0:
            return torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device)
        if self.history is None:
            self.history = torch.full((self.S, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device)
        same = self.history == argmax[None]
        if watch is not None:
            same = same | ~watch[None]
        same = same.all(dim=-1)  # [S, B]
        if self._skip is not None:  # a row with a shorter S looks at its last S entries only
            same = same | self._skip
        stable = same.all(dim=0)
        self.history = torch.cat([self.history[1:], argmax[None]], dim=0)
        return stable

    def __call__(self, argmax: torch.Tensor, z: torch.Tensor, entropy: torch.Tensor | None = None,
                 watch: torch.Tensor | None = None) -> torch.Tensor:
        """argmax [B,C], z [B,C,V] (temperature-scaled, possibly frozen) -> done [B].
        `entropy` [B,C] may be passed when already computed from z. `watch` [B,C] bool:
        only these positions count (infilling: the canvas past the template is free but discarded)."""
        if self.per_row:
            self._row_rules(argmax.device)
        h = token_entropy(z) if entropy is None else entropy
        if watch is None:
            mean = h.mean(dim=-1)
        else:
            w = watch.to(h.dtype)
            mean = (h * w).sum(-1) / w.sum(-1).clamp(min=1)
        done = self.stable(argmax, watch) & (mean < self.kappa)
        return done if self._enabled is None else done & self._enabled

    def rows(self, index, device) -> "StabilityTracker":
        """The same rules for the rows `index` (an index tensor or a slice) only: a step over part of the batch
        (row compaction) records into it, and `put_rows` writes its history back."""
        sub = StabilityTracker.__new__(StabilityTracker)
        sub.__dict__.update(self.__dict__)
        sub.history = None if self.history is None else self.history[:, index]
        if self.per_row:
            self._row_rules(device)
            sub.kappa, sub._enabled = self.kappa[index], self._enabled[index]
            sub._skip = None if self._skip is None else self._skip[:, index]
        return sub

    def put_rows(self, index: torch.Tensor, sub: "StabilityTracker") -> None:
        """Write the history of `rows(index)` back into these rows."""
        if sub.history is not None:  # S = 0 keeps none; otherwise the full step before it made this one's
            self.history[:, index] = sub.history

    def permute(self, index: torch.Tensor, order: list[int]) -> None:
        """Rows reordered: row s takes row order[s] (`index`: the same order on the device)."""
        if self.history is not None:
            self.history = self.history[:, index]
        if self.per_row and self._enabled is not None:
            self.kappa, self._enabled = self.kappa[index], self._enabled[index]
            self._skip = None if self._skip is None else self._skip[:, index]
        if self.per_row:
            self._row_S = [self._row_S[i] for i in order]
            self._enabled_list = [self._enabled_list[i] for i in order]
            self._kappa_list = [self._kappa_list[i] for i in order]
