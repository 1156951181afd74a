"""The canvas loop as a generator of events (spec 4.0-4.8).

Layering: `denoise_step` (one decoder pass + sampler arithmetic) -> `stream` (the canvas loop,
yielding `Draft` after every denoising step, `Commit` after every canvas and `Finished` at the
end) -> `generate` (the same loop consumed to the end). Streaming and non-streaming therefore
produce identical tokens by construction.

Shape legend: B batch, S prompt chunk, C canvas length, V vocab.

Invariants:
- Random draws follow the reference order: per canvas `randint[B,C]` (initial canvas, drawn even
  when the caller supplies `decoder_input_ids`), then per step `multinomial` over [B*C, V]
  followed by `randint[B,C]` (renoise). With `generator=None` torch's global generator is used,
  so after `torch.manual_seed(s)` the tokens equal transformers' for the same weights.
- Rows that finished denoising are frozen (argmax, canvas and self-conditioning logits); rows
  whose sequence finished keep being computed but are not counted in `tokens_per_forward`.
- The committed canvas is the argmax of the last executed step; the returned cache excludes the
  last committed canvas (it has not been encoded).
- No host synchronisation inside a canvas with fixed steps and one generator (or none): nothing in a
  step reads a device value on the host or copies a host value to the device (the temperature schedule
  and sqrt(H) live on the device), so a GPU's host queues steps ahead. Adaptive stopping reads `done`
  once per step (B = 1) or twice (B > 1: frozen rows); drafts and per-row generators read more.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..errors import InputError
from ..sampling import (StabilityTracker, entropy_bound_accept, sample_tokens, temperature, token_entropy,
                        uniform_tokens)
from .cache import KVCache, front_order


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

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length:]


@dataclass
class Finished:
    result: GenerationResult


def denoise_step(module, x, a_prev, sc_logits, done, n, cfg: GenerationConfig, cache, tracker, generator,
                 finished=None, fixed=None, watch=None, raw=None, sc_out=None):
    """One denoising step with remaining-step counter n (N..1). Returns x', a', sc', done', accepted.

    fixed: None, or (mask [B,C] bool, tokens [B,C]) — positions held at given tokens (infilling): their
    entropy counts as 0 in the acceptance budget and the canvas and argmax keep the given token.
    watch: None, or [B,C] bool — the positions adaptive stopping looks at (default: all; with fixed
    tokens, the free positions whose tokens are kept).
    raw: the decoder's logits for x when the caller already has them (a commit fused into this step).
    sc_out: None, or a [B,C,V] tensor in the model dtype to write the returned self-conditioning logits into (the
    CUDA-graphed decoder's own input buffer, `GraphedPasses.sc_buffer`; it may be `sc_logits` itself)."""
    if raw is None:
        raw = module.decode(x, cache, sc_logits)
    # per-row generators draw only for active rows (batch invariance); one generator draws for all
    active = ~(done | finished) if isinstance(generator, (list, tuple)) and finished is not None else None
    z = raw
    if cfg.t_min is not None and cfg.t_max is not None:
        tau = temperature(n, cfg.max_denoising_steps, cfg.t_min, cfg.t_max, raw.device)
        # in place: the decoder's logits are this step's own and unused after (one [B,C,V] fp32 buffer fewer)
        z = raw / tau if raw.requires_grad else raw.div_(tau)
    y = sample_tokens(z, generator, active)
    a = torch.argmax(z, dim=-1)
    h = token_entropy(z)
    accepted = entropy_bound_accept(h if fixed is None else h.masked_fill(fixed[0], 0.0), cfg.entropy_bound)
    noise = uniform_tokens(x.shape[0], x.shape[1], z.shape[-1], x.device, generator, active)
    x_new = torch.where(accepted, y, noise)
    if fixed is not None:
        x_new, a = clamp(x_new, fixed), clamp(a, fixed)
    if tracker is not None:
        # a single row is never done at a step's start (the loop ends when it stops): no host sync for it
        if x.shape[0] > 1 and bool(done.any()):
            a = torch.where(done[:, None], a_prev, a)
            x_new = torch.where(done[:, None], x, x_new)
            z = torch.where(done[:, None, None], sc_logits, z)
        done = done | tracker(a, z, watch=watch)
    return x_new, a, z.to(module.dtype) if sc_out is None else sc_out.copy_(z), done, accepted


def _compact_step(step_fn, module, x, a, sc, done, n, cfg, cache, tracker, generator, finished, fixed, watch, sub):
    """`step_fn` over the rows not yet done (frozen rows keep their state, as in the full step), results
    written back into full-batch tensors. sub: (row ids, cache rows) of the previous call, reused while the
    set of active rows is the same (the cache rows are gathered only when a row stops)."""
    rows = (~done).nonzero().squeeze(1)
    if sub is None or not torch.equal(sub[0], rows):
        sub = (rows, cache.rows(rows, room=x.shape[1]))  # room: the decoder writes its canvas there
    hist = tracker.history if tracker is not None else None
    if hist is not None:
        tracker.history = hist[:, rows]
    xs, as_, scs, dones, acc = step_fn(
        module, x[rows], a[rows], sc[rows], done[rows], n, cfg, sub[1], tracker, [generator[i] for i in rows.tolist()],
        finished[rows], fixed=None if fixed is None else (fixed[0][rows], fixed[1][rows]),
        watch=None if watch is None else watch[rows])
    if hist is not None:
        hist[:, rows] = tracker.history
        tracker.history = hist
    x, a, done = x.clone(), a.clone(), done.clone()  # earlier Drafts may alias these (.cpu() of a cpu tensor)
    x[rows], a[rows], sc[rows], done[rows] = xs, as_, scs, dones  # sc: the last step's output, owned here
    accepted = torch.zeros_like(done[:, None].expand_as(x))
    accepted[rows] = acc
    return x, a, sc, done, accepted, sub


def _compact_pass(step_fn, module, x, a, sc, done, n, cfg, cache, tracker, generator, finished, fixed, watch, sub):
    """One generator for the batch: the decoder runs on the rows not yet done, the sampler on every row (its
    random draws use as many numbers whatever the logits, so every row draws what the full step draws; the frozen
    rows' logits are zeros and their results are replaced by their frozen state, as in the full step). sub: as in
    `_compact_step`."""
    rows = (~done).nonzero().squeeze(1)
    if sub is None or not torch.equal(sub[0], rows):
        sub = (rows, cache.rows(rows, room=x.shape[1]))  # room: the decoder writes its canvas there
    part = module.decode(x[rows], sub[1], sc[rows])  # [k, C, V] fp32
    raw = part.new_zeros(x.shape[0], *part.shape[1:])
    raw[rows] = part
    del part
    x, a, sc, done_new, accepted = step_fn(module, x, a, sc, done, n, cfg, cache, tracker, generator, finished,
                                           fixed=fixed, watch=watch, raw=raw)
    return x, a, sc, done_new, accepted & ~done[:, None], sub


def clamp(tokens: torch.Tensor, fixed) -> torch.Tensor:
    """tokens [B,C] with the fixed positions (mask, values) written in."""
    return tokens if fixed is None else torch.where(fixed[0], fixed[1], tokens)


def stream(module, input_ids: torch.Tensor, cfg: GenerationConfig, canvas_length: int,
           attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
           cache: KVCache | None = None, decoder_input_ids: torch.Tensor | None = None,
           self_conditioning_logits: torch.Tensor | None = None, drafts: bool = True, sampler: str = "exact",
           fixed_tokens: torch.Tensor | None = None, fuse_commit: bool = False, compact_rows: bool | None = None):
    """Yield Draft / Commit events and a final Finished(result).

    input_ids [B, S]: the tokens not yet in `cache` (the whole prompt when cache is None).
    attention_mask [B, S] (1 = token, 0 = left padding) for those tokens.
    generator: None (global RNG), one torch.Generator, or a list of B generators (one per row).
    sampler: "exact" (the reference's arithmetic and draws) or "fast" (the fused one-pass sampler of
    kernels/sampler_fused.py: same distribution, different random stream).
    fixed_tokens [B, L] (infilling / editing in place): token ids the new tokens must hold, -1 where the
    model decides, -2 where it decides but the caller will discard the token; adaptive stopping then
    looks only at the -1 positions (columns past L count as -1). Canvas c holds columns [c*C, (c+1)*C) fixed
    from its first step to its commit (the model sees them, as it sees unreplaced positions in
    training); L may span several canvases. Random draws are unchanged, so fixing nothing (all -1)
    gives the same tokens as no `fixed_tokens`.
    fuse_commit: encode each committed canvas in the same pass as the next canvas's first denoising step
    (`module.encode_decode`: one read of the weights instead of two; the same function up to fp32
    summation order, so tokens match the reference unless a draw sits on a rounding-level tie).
    compact_rows: run each denoising step's decoder pass on the rows still denoising only (rows that stopped are
    frozen, so their pass is wasted work: in a batch with adaptive stopping most rows stop long before the last
    one). With one generator per row the sampler also runs on those rows only (each row's draws are its own);
    with one generator (or none) for the batch it runs on every row, so that the random stream is the
    uncompacted loop's. Either way the tokens equal the uncompacted loop's up to fp32 rounding of the smaller
    batch's matmuls. Under CUDA graphs (per-row generators only) the rows still denoising are swapped into the
    lowest rows of the cache and the graphs of that batch size run on a prefix view of it, as the server does;
    events and the result come back in the caller's row order. None (default): on with per-row generators and
    B > 1; off with one generator (the reference's arithmetic, batch for batch).
    """
    if sampler == "exact":
        step_fn = denoise_step
    elif sampler == "fast":
        from ..kernels.sampler_fused import denoise_step_fast as step_fn
    else:
        raise InputError(f"unknown sampler {sampler!r}; use 'exact' or 'fast'")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError(f"input_ids must be a non-empty [batch, length] tensor, got shape {list(input_ids.shape)}")
    B, S = input_ids.shape
    V, C, N = module.text.vocab_size, canvas_length, cfg.max_denoising_steps
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
        raise InputError(f"input_ids contain ids outside the vocabulary [0, {V}); tokenize with this model's tokenizer")
    cfg.check_vocab(V)
    dev = module.device
    input_ids = input_ids.to(dev)
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise InputError(f"got {len(generator)} generators for a batch of {B}; give one per row")
    for g in (generator if isinstance(generator, (list, tuple)) else [generator]):
        if g is not None and g.device.type != dev.type:
            raise InputError(f"the generator is on {g.device.type} but the model is on {dev}: the noise is drawn "
                             f"where the model runs; make it with torch.Generator(device={dev.type!r}).manual_seed(...)")
    T_start = cache.length if cache is not None else 0
    cur_len = T_start + S
    n_canvases = math.ceil(cfg.max_new_tokens / C)
    max_length = cur_len + cfg.max_new_tokens
    limit = module.text.max_position_embeddings
    if cur_len + n_canvases * C > limit:
        raise InputError(f"prompt ({cur_len} tokens) + {n_canvases} canvas(es) of {C} exceeds "
                         f"max_position_embeddings={limit}; shorten the prompt or lower max_new_tokens")
    if cache is None:
        # every commit, and one canvas of room past the last: the decoder writes each canvas's K/V there (scratch)
        cache = module.new_cache(B, cur_len + n_canvases * C)
    elif cache.batch != B:
        raise InputError(f"cache was built for batch {cache.batch}, got input batch {B}")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, S):
            raise InputError(f"attention_mask shape {list(attention_mask.shape)} must equal input_ids shape {[B, S]}")
        attention_mask = attention_mask.to(dev).bool()
    if fixed_tokens is not None:
        fixed_tokens = torch.as_tensor(fixed_tokens, dtype=torch.long)
        if fixed_tokens.dim() != 2 or fixed_tokens.shape[0] != B:
            raise InputError(f"fixed_tokens must be [batch={B}, length], got shape {list(fixed_tokens.shape)}")
        if fixed_tokens.shape[1] > n_canvases * C:
            raise InputError(f"fixed_tokens spans {fixed_tokens.shape[1]} tokens but max_new_tokens="
                             f"{cfg.max_new_tokens} gives {n_canvases} canvas(es) of {C}; raise max_new_tokens")
        if fixed_tokens.numel() and (int(fixed_tokens.min()) < -2 or int(fixed_tokens.max()) >= V):
            raise InputError(f"fixed_tokens must hold ids in [0, {V}), -1 (free) or -2 (free, discarded)")
        pad_to = n_canvases * C - fixed_tokens.shape[1]
        fixed_tokens = torch.nn.functional.pad(fixed_tokens, (0, pad_to), value=-1).to(dev)
    per_row = isinstance(generator, (list, tuple))
    # CUDA-graphed passes capture one shape per batch size: there, compaction swaps the rows still denoising into
    # the lowest rows (slots) and runs the graphs of that prefix, which needs per-row generators (with one
    # generator the sampler draws for every row, in the caller's row order)
    graphs = vars(module).get("_graphed_passes")  # kernels.graphs.installed(module), without the import cycle
    graphed = graphs is not None
    if compact_rows and graphed and not per_row:
        raise InputError("compact_rows=True with one generator cannot run on CUDA-graphed passes; give one "
                         "generator per row (generator=[...]), or generate without CUDA graphs")
    compact = per_row and B > 1 if compact_rows is None else bool(compact_rows)
    # CUDA graphs: each step's self-conditioning logits go straight into the decoder graph's input buffer
    sc_out = graphs.sc_buffer(B, C) if graphed else None
    eos = torch.tensor(cfg.eos_token_id, device=dev) if cfg.eos_token_id is not None else None
    pad = cfg.pad_token_id
    tracker = StabilityTracker(cfg.stability_threshold, cfg.confidence_threshold,
                               cfg.max_denoising_steps) if cfg.adaptive else None

    seq = input_ids
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    passes = torch.zeros(B, dtype=torch.int32, device=dev)
    # compaction under graphs: slot s holds the caller's row perm[s] (all per-row state is kept in slot order and
    # put back in the caller's order, by the index `back`, for every event and the result); None: no row moved
    perm, back = list(range(B)), None

    def in_order(t):
        return t if back is None else t[back]

    def to_front(active: list[int]) -> None:
        """Swap rows so that the `active` ones hold slots [0, len(active)): their K/V, padding, canvas, argmax,
        self-conditioning logits (in the graphs' buffer), stopping history, generator and the rest."""
        nonlocal x, a, sc, done, finished, passes, seq, fixed, watch, fixed_tokens, generator, perm, back
        order = front_order(active, B)
        idx = torch.tensor(order, device=dev)
        dst = [s_ for s_, o in enumerate(order) if o != s_]
        cache.move_rows(dst, [order[s_] for s_ in dst])
        sc[dst] = sc[[order[s_] for s_ in dst]]
        x, a, done, finished, passes, seq = (t[idx] for t in (x, a, done, finished, passes, seq))
        fixed = None if fixed is None else (fixed[0][idx], fixed[1][idx])
        watch = None if watch is None else watch[idx]
        fixed_tokens = None if fixed_tokens is None else fixed_tokens[idx]
        if tracker.history is not None:  # None: stopping by confidence alone keeps no history
            tracker.history = tracker.history[:, idx]
        generator = [generator[o] for o in order]
        perm = [perm[o] for o in order]
        back = None if perm == list(range(B)) else torch.tensor(perm, device=dev).argsort()
    steps_per_canvas, canvas_seconds = [], []
    t_start = time.perf_counter()
    prefill_seconds = first_commit = 0.0
    chunk, chunk_mask = input_ids, attention_mask
    try:
        with torch.no_grad():
            for c in range(n_canvases):
                t_canvas = time.perf_counter()
                fused = fuse_commit and c > 0  # the commit runs inside this canvas's first step
                if not fused:
                    module.encode(chunk, cache, pad_mask=chunk_mask, output=False)  # only the cache is needed
                if c == 0:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    prefill_seconds = time.perf_counter() - t_start
                x = uniform_tokens(B, C, V, dev, generator, ~finished)
                sc = None
                if c == 0 and decoder_input_ids is not None:
                    x = decoder_input_ids.to(dev)
                fixed = watch = None
                if fixed_tokens is not None:
                    cols = fixed_tokens[:, c * C:(c + 1) * C]
                    if bool((cols >= 0).any()):
                        fixed = (cols >= 0, cols.clamp(min=0))
                        x = clamp(x, fixed)
                    if bool((cols != -1).any()):  # stopping looks only at what the model decides and the caller keeps
                        watch = cols == -1
                if c == 0 and self_conditioning_logits is not None:
                    sc = self_conditioning_logits.to(dev)
                a = x
                done = torch.zeros(B, dtype=torch.bool, device=dev)
                if tracker is not None:
                    tracker.reset()
                steps = 0
                sub = None  # row compaction: (active row ids, their cache rows)
                for n in range(N, 0, -1):
                    passes += ~(done | finished)
                    if compact and graphed and tracker is not None and steps > 0 and bool(done.any()):
                        active = (~done).nonzero().squeeze(1).tolist()
                        k = len(active)
                        if active != list(range(k)):
                            to_front(active)
                        if sub is None or sub[0] != k:  # the prefix's cache view, made once per size
                            sub = (k, cache.view_rows(0, k))
                        hist = tracker.history
                        if hist is not None:
                            tracker.history = hist[:, :k]
                        xs, as_, _, dones, acc = step_fn(
                            module, x[:k], a[:k], sc[:k], done[:k], n, cfg, sub[1], tracker, generator[:k],
                            finished[:k], fixed=None if fixed is None else (fixed[0][:k], fixed[1][:k]),
                            watch=None if watch is None else watch[:k], sc_out=sc[:k])
                        if hist is not None:
                            hist[:, :k] = tracker.history
                            tracker.history = hist
                        x, a, done = x.clone(), a.clone(), done.clone()  # earlier Drafts may alias them
                        x[:k], a[:k], done[:k] = xs, as_, dones
                        accepted = torch.zeros_like(x, dtype=torch.bool)
                        accepted[:k] = acc
                    elif compact and tracker is not None and steps > 0 and bool(done.any()):
                        x, a, sc, done, accepted, sub = (_compact_step if per_row else _compact_pass)(
                            step_fn, module, x, a, sc, done, n, cfg, cache, tracker, generator, finished, fixed, watch,
                            sub)
                    else:
                        raw = module.encode_decode(chunk, x, cache, chunk_mask, sc) if fused and steps == 0 else None
                        x, a, sc, done, accepted = step_fn(module, x, a, sc, done, n, cfg, cache, tracker, generator,
                                                           finished, fixed=fixed, watch=watch, raw=raw, sc_out=sc_out)
                    steps += 1
                    if drafts:
                        yield Draft(c, steps, N, in_order(a).cpu(), in_order(accepted).cpu(), in_order(done).cpu())
                    if tracker is not None and bool(done.all()):  # fixed steps: nothing to ask the device
                        break
                seq = torch.cat([seq, a], dim=-1)
                new = seq[:, -C:]
                finished_now = torch.zeros(B, dtype=torch.bool, device=dev)
                if eos is not None:
                    finished_now |= torch.isin(new, eos).any(dim=-1)
                if T_start + seq.shape[1] >= max_length:
                    finished_now[:] = True
                prev = finished
                finished = prev | finished_now
                if pad is not None and bool(finished.any()):
                    new[prev] = pad
                    if eos is not None and bool(finished_now.any()):
                        is_eos = torch.isin(new, eos)
                        cs = is_eos.cumsum(dim=-1)
                        new[(cs > 0) & ~((cs == 1) & is_eos)] = pad
                elapsed = time.perf_counter() - t_canvas
                steps_per_canvas.append(steps)
                canvas_seconds.append(elapsed)
                committed = in_order(new).cpu()
                if c == 0:
                    first_commit = time.perf_counter() - t_start
                yield Commit(c, committed, in_order(finished).cpu(), steps, elapsed)
                if bool(finished.all()):
                    break
                chunk, chunk_mask = seq[:, -C:], None
    finally:  # also when the caller stops reading early: a cache of theirs must not stay in slot order
        if back is not None:  # the caller's row order again, the cache's rows too
            cache.move_rows(list(range(B)), back)
            seq, passes = seq[back], passes[back]
    new_tokens = seq[:, S:]
    valid = (new_tokens != pad).sum(dim=-1) if pad is not None else new_tokens.shape[1]
    result = GenerationResult(
        sequences=seq, tokens_per_forward=valid / passes, steps_per_canvas=steps_per_canvas,
        canvas_seconds=canvas_seconds, prompt_length=S, prefill_seconds=prefill_seconds,
        first_commit_seconds=first_commit, total_seconds=time.perf_counter() - t_start,
        forward_passes=passes, cache=cache)
    yield Finished(result)


def generate(module, input_ids, cfg, canvas_length, **kwargs) -> GenerationResult:
    """Non-streaming generation: the same loop as `stream`, consumed to the end."""
    for event in stream(module, input_ids, cfg, canvas_length, drafts=False, **kwargs):
        if isinstance(event, Finished):
            return event.result
    raise RuntimeError("generation loop ended without a result")  # unreachable
