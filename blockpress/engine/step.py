"""One denoising step, composed once for every caller (Python batches, the server, the task solvers).

Shape legend: B rows, C canvas length, V vocab.

From the decoder's fp32 logits of the rows that ran, a step: adds the row's logit bias (where one is asked for),
divides by the row's temperature, draws a token
per position and takes the argmax and the entropy (the sampler: `sampling`'s reference arithmetic, or the fused
one-pass kernel of `kernels.sampler_fused`, which reads the LM head's product and applies the soft cap itself),
walks the canvas of a row with a grammar (or a token ban) through it (`constraint`), accepts the lowest-entropy
positions within the entropy bound (a grammar's forced tokens and an infilling canvas's given ones count as
certain), renoises the rest, holds the given tokens of an infilling canvas, keeps the rows that stopped as they
were (frozen), and asks the stopping rule which rows are done.

Invariants:
- Random draws follow the reference's order: with one stream for the batch, `multinomial` over [B*C, V] then
  `randint[B, C]` for every row, frozen ones included; with a stream per row, the same per row, only for rows
  that draw (not frozen, not finished), so a row's tokens do not depend on its neighbours.
- The sampler's arithmetic is row by row (temperature, softmax, argmax, entropy, sort), so a row computes the
  same numbers in any batch: one setting for the batch and per-row settings give the same bits.
- Tensors handed out in events are never written again: every step makes new x, a and done.
"""

from __future__ import annotations

import torch

from ..kernels.sampler_fused import capped_logits, fused_sample
from ..sampling import entropy_bound_accept, sample_tokens, token_entropy, uniform_tokens
from .canvas import Canvas, clamp, entropy_bound, stopping_rule
from .constraint import constrain


def sampler_cap(module, fast: bool) -> tuple[bool, float | None]:
    """(capped, cap): whether the decoder's passes hand the sampler soft-capped fp32 logits (`decode(capped=)`),
    and the soft cap the sampler applies itself otherwise. The fast sampler reads the LM head's product and caps
    it in its one pass (`lm_logits(capped=False)`); the exact one reads the reference's logits."""
    return not fast, (module.text.final_logit_softcapping if fast else None)


def _batched(taus: list | None, device):
    """One tau for the rows: the shared 0-dim tensor where all rows have the same one, else [B, 1, 1] (fp32; 1 for a
    row without a schedule)."""
    if taus is None:
        return None
    if all(t is taus[0] for t in taus):
        return taus[0]
    ones = torch.ones((), dtype=torch.float32, device=device) if any(t is None for t in taus) else None
    return torch.stack([ones if t is None else t for t in taus]).view(-1, 1, 1)


def _sample(raw, taus, gen, active, fast: bool, dtype, out, cap=None, bias=None, biased=None):
    """(y sample, a argmax, h entropy [k, C], z = (raw + bias) / tau [k, C, V]) for the rows of `raw` (cap: raw is
    the LM head's product before this soft cap, which the fast sampler applies; bias [k, 1, V] or None, biased [k]:
    which rows have one)."""
    if fast and not isinstance(gen, list):  # one stream: one fused pass over the batch (z written into `out`)
        return fused_sample(raw, _batched(taus, raw.device), gen, out_dtype=dtype, out=out, cap=cap, bias=bias)
    if fast:  # a stream per row: one fused pass per row that draws, seeded from its generator
        parts = []
        for i, (g, on) in enumerate(zip(gen, active)):
            tau = None if taus is None else taus[i]
            r, b = raw[i:i + 1], bias[i:i + 1] if bias is not None and biased[i] else None
            if on:
                parts.append(fused_sample(r, tau, g, out_dtype=dtype, cap=cap, bias=b))
            else:  # finished rows still get an argmax and an entropy (their stopping rule runs), not a draw
                z = capped_logits(r, cap, b)
                z = z if tau is None else z / tau
                parts.append((torch.zeros(1, raw.shape[1], dtype=torch.long, device=raw.device),
                              z.argmax(dim=-1), token_entropy(z), z.to(dtype)))
        return tuple(torch.cat(p) for p in zip(*parts))
    if cap:
        raise ValueError("the exact sampler reads soft-capped logits; only the fast one applies the cap")
    tau = _batched(taus, raw.device)
    # in place: the decoder's logits are this step's own and unused after (one [B,C,V] fp32 buffer fewer)
    if bias is not None:
        raw = raw + bias if raw.requires_grad else raw.add_(bias)
    z = raw if tau is None else raw / tau if raw.requires_grad else raw.div_(tau)
    return sample_tokens(z, gen, active), torch.argmax(z, dim=-1), token_entropy(z), z


def _compose(cv: Canvas, idx: list[int], raw, x, a_prev, sc_prev, done, fixed, watch, tracker, bound, fast: bool,
             dtype, sc_out, cap, bias):
    """The step over the rows `idx` of the canvas (raw [k, C, V] their logits): new x, a, self-conditioning
    logits, done and accepted for those rows."""
    frozen = any(cv.done_host[i] for i in idx)
    active = [not (cv.done_host[i] or cv.rows[i].finished) for i in idx]  # rows that draw (a stream per row)
    y, a, h, z = _sample(raw, cv.taus(idx), cv.generators(idx), active, fast, dtype, None if frozen else sc_out,
                         cap, bias, [cv.rows[i].bias is not None for i in idx])
    a, y, forced = constrain(cv, idx, a, y, z)
    certain = fixed[0] if fixed is not None else None  # positions accepted whatever their entropy
    if forced is not None:
        certain = forced if certain is None else certain | forced
    accepted = entropy_bound_accept(h if certain is None else h.masked_fill(certain, 0.0), bound)
    noise = uniform_tokens(x.shape[0], x.shape[1], raw.shape[-1], x.device, cv.generators(idx), active)
    x_new = clamp(torch.where(accepted, y, noise), fixed)
    a = clamp(a, fixed)
    if frozen:  # stopped rows keep their canvas, argmax and self-conditioning logits; they accept nothing
        a = torch.where(done[:, None], a_prev, a)
        x_new = torch.where(done[:, None], x, x_new)
        if sc_prev is not None:  # (a row stopped before the first step, e.g. cancelled on admission, has none)
            z = torch.where(done[:, None, None], sc_prev, z)
        accepted = accepted & ~done[:, None]
    if tracker is not None:
        done = done | tracker(a, z, entropy=h, watch=watch)
    sc = z.to(dtype) if sc_out is None else z if z is sc_out else sc_out.copy_(z)
    return x_new, a, sc, done, accepted


def denoise_step(cv: Canvas, raw: torch.Tensor, rows=None, fast: bool = False, dtype=torch.float32,
                 sc_out: torch.Tensor | None = None, cap: float | None = None) -> torch.Tensor:
    """Advance the canvas by one step from the decoder's logits `raw` of the rows `rows` (None: every row;
    a slice: a prefix of the batch, CUDA graphs' row compaction; a list: those rows, row compaction). Rows
    outside `rows` stay as they are. sc_out: the tensor to write the rows' self-conditioning logits into (the
    CUDA-graphed decoder's input buffer). cap (fast only): raw is the LM head's product before this soft cap,
    which the sampler's pass applies. Returns accepted [B, C] (False on rows that did not run)."""
    B = len(cv.rows)
    if rows is None:
        x, a, sc, done, acc = _compose(cv, list(range(B)), raw, cv.x, cv.a, cv.sc, cv.done, cv.fixed, cv.watch,
                                       cv.tracker, cv.bound, fast, dtype, sc_out, cap, cv.bias)
        cv.x, cv.a, cv.sc, cv.done = x, a, sc, done
        return acc
    if isinstance(rows, slice):
        idx, sel = list(range(B))[rows], rows
    else:
        idx, sel = rows, torch.tensor(rows, device=raw.device)
    fixed = None if cv.fixed is None else (cv.fixed[0][sel], cv.fixed[1][sel])
    bound = cv.bound[sel] if isinstance(cv.bound, torch.Tensor) else cv.bound
    tracker = None if cv.tracker is None else cv.tracker.rows(sel, raw.device)
    sc_prev = None if cv.sc is None else cv.sc[sel]
    x, a, sc, done, acc = _compose(cv, idx, raw, cv.x[sel], cv.a[sel], sc_prev, cv.done[sel], fixed,
                                   None if cv.watch is None else cv.watch[sel], tracker, bound, fast, dtype,
                                   sc_out, cap, None if cv.bias is None else cv.bias[sel])
    if tracker is not None:
        cv.tracker.put_rows(sel, tracker)
    cv.x, cv.a, cv.done = cv.x.clone(), cv.a.clone(), cv.done.clone()  # earlier events hold the old tensors
    cv.x[sel], cv.a[sel], cv.done[sel] = x, a, done
    if sc_out is None:
        cv.sc[sel] = sc
    accepted = torch.zeros_like(cv.x, dtype=torch.bool)
    accepted[sel] = acc
    return accepted


def single_step(module, canvas: torch.Tensor, sc: torch.Tensor | None, cfg, cache, n: int | None = None,
                generator=None, fast: bool = False, passes=None, sc_out=None, raw=None):
    """One denoising step of a canvas [B, C] outside a generation (memory accounting, tests): the decoder pass
    (`passes`, default the module's own; or the logits `raw` given) and the step, as the loop runs them, with n
    steps left (default: the first step). Returns the Canvas after the step and its accepted positions."""
    from .rows import Row

    rows = [Row(cfg, 1) for _ in range(canvas.shape[0])]
    for r in rows:
        r.start_canvas()
        r.left = cfg.max_denoising_steps if n is None else n
    cv = Canvas(rows, canvas, sc, None, None, stopping_rule(rows), entropy_bound(rows, canvas.device), generator,
                isinstance(generator, list))
    capped, cap = sampler_cap(module, fast)
    if raw is None:
        raw = (passes or module).decode(canvas, cache, sc, capped=capped)
    return cv, denoise_step(cv, raw, None, fast, module.dtype, sc_out, cap)
