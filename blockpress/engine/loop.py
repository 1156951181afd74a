"""The canvas loop over a row batch, as a generator of events: written once, for every caller.

Shape legend: B rows, S prompt length, C canvas length, V vocab.

`Engine.canvas()` runs one canvas boundary and one denoised canvas:
1. rows that ended or were cancelled leave (where the source evicts: a server; a Python batch keeps its rows);
2. the committed canvas is encoded into the cache (or, with `fuse_commit` and nobody waiting, in the same pass
   as the next canvas's first denoising step);
3. rows join (`Admitted`): their prompts are prefilled, ending where the batch's cache ends;
4. every row draws a canvas of noise and denoises it, a `Stepped` event per step, until each row has stopped
   (its stopping rule, its step budget, or a cancel);
5. the commit rule turns the last argmax canvas into committed tokens (`Committed`), with their
   log-probabilities under the last step's distribution for the rows that asked (`Job.logprobs`).

A *source* decides who joins and leaves: `Scheduler` (a server: a queue, the padding rule, eviction) or a
Python batch submitted at once. The device work is the `Runner`'s, the step's arithmetic `step.denoise_step`'s.

Host reads per step: none with fixed steps (the temperature schedule lives on the device); one (`done` of every
row) when a row stops adaptively. Per canvas: the commit rule's flags, and what consumers read of the events.
"""

from __future__ import annotations

import time

import torch

from ..sampling import uniform_tokens
from .canvas import Canvas, clamp, entropy_bound, held_tokens, stopping_rule
from .commit import commit, token_logprobs
from .events import Admitted, Committed, Stepped
from .step import denoise_step, sampler_cap


class Engine:
    def __init__(self, runner, source, sampler: str = "exact", fuse_commit: bool = False, per_row: bool = True,
                 shared: torch.Generator | None = None):
        """per_row: every row draws from its own generator; else the batch from `shared` (None: torch's global
        generator, the reference's draw order)."""
        self.runner, self.source = runner, source
        self.fast, self.fuse = sampler == "fast", fuse_commit
        self.capped, self.cap = sampler_cap(runner.module, self.fast)  # who applies the soft cap
        self.per_row, self.shared = per_row, shared
        self.rows: list = []
        self.admitting: list = []  # taken from the source, not yet rows (failed together with them on an error)
        self.first = None  # (canvas [B, C] or None, self-conditioning logits or None) for the next canvas only

    def reset(self) -> None:
        """Forget every row and the cache (after an error: the rows were failed)."""
        self.rows, self.admitting = [], []
        self.runner.cache = self.runner.committed = None

    @torch.no_grad()  # wraps each resumption of the generator: the caller's code between events keeps its own mode
    def canvas(self):
        """One canvas boundary and one denoised canvas for every row: yields Admitted, Stepped and Committed."""
        t0 = time.perf_counter()
        keep = self.source.keep(self.rows)
        if keep is not None and len(keep) < len(self.rows):
            self.runner.keep(keep)
            self.rows = [self.rows[i] for i in keep]
        pending = None
        if self.rows and self.runner.committed is not None:
            if self.fuse and not self.source.waiting():  # nobody joins: nothing to encode between commit and step
                pending, self.runner.committed = self.runner.committed, None
            else:
                self.runner.commit()
        if pending is None:
            joined = self._admit()
            if joined:
                yield Admitted(joined)
        if self.rows:
            yield from self._denoise(pending, t0)

    def _admit(self) -> list:
        run = self.runner
        adm = self.source.admit(self.rows, run.cache.length if self.rows else None)
        if adm is None or not adm.rows:
            return []
        self.admitting = adm.rows
        ids, mask = adm.ids, adm.mask
        if ids is None:  # left-pad the prompts to end together
            S = max(r.prompt_length for r in adm.rows)
            ids = [[0] * (S - r.prompt_length) + list(r.job.prompt_ids) for r in adm.rows]
            mask = [[False] * (S - r.prompt_length) + [True] * r.prompt_length for r in adm.rows]
            ids = torch.tensor(ids, dtype=torch.long, device=run.device)
            mask = None if all(map(all, mask)) else torch.tensor(mask, device=run.device)
        horizon = max(r.n_canvases for r in adm.rows)
        prompts = [r.job.prompt_ids for r in adm.rows] if run.prefixes is not None else None
        reused, written = run.prefill(ids, mask, adm.end, adm.end + horizon * run.C, adm.cache, prompts)
        if reused or written:  # (one row joined alone: the prefix cache's own counts, which its usage reports)
            adm.rows[0].cached_tokens, adm.rows[0].cache_write_tokens = reused, written
        self.rows, self.admitting = self.rows + adm.rows, []
        return adm.rows

    def _start(self):
        """A canvas of noise for every row (the initial draw), its held tokens and rules."""
        rows, run = self.rows, self.runner
        B, C, V, dev = len(rows), run.C, run.V, run.device
        for r in rows:
            r.start_canvas()
        gen = [r.generator for r in rows] if self.per_row else self.shared
        x = uniform_tokens(B, C, V, dev, gen, [not r.finished for r in rows])
        sc = None
        if self.first is not None:
            (x0, sc0), self.first = self.first, None
            x = x if x0 is None else x0.to(dev)
            sc = None if sc0 is None else sc0.to(dev)
        fixed, watch = held_tokens(rows, C, dev)
        return Canvas(rows, clamp(x, fixed), sc, fixed, watch, stopping_rule(rows), entropy_bound(rows, dev),
                      self.shared, self.per_row)

    def _spent(self, cv) -> None:
        """Rows out of steps, or cancelled, stop here (frozen until the commit)."""
        spent = [i for i, r in enumerate(cv.rows) if not cv.done_host[i] and (r.left <= 0 or r.cancelled)]
        for i in spent:
            cv.done_host[i] = True
        if spent and not all(cv.done_host):  # others go on: these are frozen on the device too
            cv.done = cv.done.index_fill(0, torch.tensor(spent, device=cv.done.device), True)

    def _denoise(self, pending, t0: float):
        run, cv = self.runner, self._start()
        dtype = run.module.dtype
        sc_out = run.sc_out(len(cv.rows))
        while True:
            self._spent(cv)
            ran = [r for r, d in zip(cv.rows, cv.done_host) if not d]
            if not ran:
                break
            for r in ran:
                r.passes += not r.finished
            raw, which = run.decode(cv, pending, capped=self.capped)
            pending = None
            out = sc_out if which is None else sc_out[which] if isinstance(which, slice) and sc_out is not None \
                else None
            accepted = denoise_step(cv, raw, which, self.fast, dtype, out, self.cap)
            del raw
            cv.steps += 1
            for r in ran:
                r.steps, r.left = r.steps + 1, r.left - 1
            if cv.tracker is not None:  # one read a step for every row's stop flag
                cv.done_host = cv.done.tolist()
            ran_ids = {id(r) for r in ran}
            yield Stepped(cv.rows, cv.steps, cv.a, accepted, cv.done, [id(r) in ran_ids for r in cv.rows])
        if pending is not None:  # no row ran (all cancelled): the committed canvas still goes into the cache
            run.committed = pending
            run.commit()
        tokens, finished = commit(cv.a, cv.rows)
        logprobs = token_logprobs(cv.sc, tokens, cv.rows)  # before the rows' `finished` moves on
        if any(r.constraint is not None for r in cv.rows):  # the grammars continue from the committed tokens
            for r, t in zip(cv.rows, tokens.tolist()):
                # a cancelled row's canvas is no output (it may hold the noise it started from, which its grammar
                # never walked): nothing continues from it
                if r.constraint is not None and not r.cancelled:
                    r.constraint.advance(t)
        now = time.perf_counter()
        for r, f in zip(cv.rows, finished):
            r.steps_per_canvas.append(r.steps)
            r.canvas += 1
            r.finished = f
            if r.canvas == 1:
                r.first_commit = now - r.started
        run.end_canvas(tokens)
        yield Committed(cv.rows, tokens, finished, cv.steps, now - t0, logprobs)
