"""Python generation: a batch submitted at once to the canvas loop, its events in the caller's row order.

Layering: `step.denoise_step` (one step's arithmetic) -> `loop.Engine.canvas` (the canvas loop, the same for the
server) -> `stream` (the caller's batch: Draft after every step, Commit after every canvas, Finished at the end)
-> `generate` (the same stream consumed to the end). Streaming and non-streaming produce identical tokens by
construction.

Shape legend: B batch, S prompt chunk, C canvas length, V vocab.

Invariants:
- Random draws follow the reference order: per canvas `randint[B,C]` (initial canvas, drawn even when the
  caller supplies `decoder_input_ids`), then per step `multinomial` over [B*C, V] followed by `randint[B,C]`
  (renoise). With `generator=None` torch's global generator is used, so after `torch.manual_seed(s)` the tokens
  equal transformers' for the same weights. A list of generators gives every row its own stream.
- A Python batch keeps its rows to the end (the caller gets the batch's cache back): a row whose sequence ended
  is still computed (with one stream it still draws: the reference's order), not counted in
  `tokens_per_forward`, and commits pad where a pad id is set. Nor are the positions `fixed_tokens` holds or
  discards: `tokens_per_forward` counts the tokens the model chose, as the server's usage does.
- The committed canvas is the argmax of the last executed step; the returned cache excludes the last committed
  canvas (it has not been encoded).
"""

from __future__ import annotations

import math
import time

import torch

from ..config import MAX_SEED, MIN_SEED, GenerationConfig, torch_seed
from ..errors import InputError, SamplingError
from ..options import Options
from ..sampling import bias_vector
from ..model.cache import KVCache
from .events import Admitted, Commit, Committed, Draft, Finished, GenerationResult, Stepped
from .loop import Engine
from .rows import Row
from .runner import Runner
from .scheduler import Admission

__all__ = ["stream", "generate", "Draft", "Commit", "Finished", "GenerationResult"]


class _Batch:
    """The source of a Python batch: its rows join once, with the caller's prompts, mask and cache; none leave."""

    def __init__(self, admission: Admission):
        self.admission = admission

    def keep(self, rows):
        return None

    def waiting(self) -> bool:
        return False

    def admit(self, rows, length):
        admission, self.admission = self.admission, None
        return admission


def _fixed_ids(fixed_tokens) -> torch.Tensor:
    """`fixed_tokens` as a LongTensor, from a tensor, an array or nested lists of an integer type (InputError
    otherwise: a float id was truncated, a bool mask read as ids 0 and 1, and ragged lists or strings raised
    torch's own error)."""
    try:
        t = torch.as_tensor(fixed_tokens)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"fixed_tokens must be [batch, length] integer token ids (a tensor, or lists of equal length "
                         f"holding ints); got a {type(fixed_tokens).__name__} that is not") from None
    if t.numel() and (t.dtype == torch.bool or t.is_floating_point() or t.is_complex()):
        raise InputError(f"fixed_tokens must hold integer token ids (-1 free, -2 free and discarded), got dtype "
                         f"{str(t.dtype).replace('torch.', '')}; pass ids, not a mask or floats")
    return t.long()


def _check(module, input_ids, cfg, C, attention_mask, generator, cache, fixed_tokens):
    """Validated inputs on the model's device: (input_ids, attention_mask, fixed_tokens padded to whole
    canvases, number of canvases, cache length before the prompt)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise InputError(f"input_ids must be a non-empty [batch, length] tensor, got shape {list(input_ids.shape)}")
    B, S = input_ids.shape
    V = module.text.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
        raise InputError(f"input_ids contain ids outside the vocabulary [0, {V}); tokenize with this model's tokenizer")
    cfg.check_vocab(V)
    dev = module.device
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise InputError(f"got {len(generator)} generators for a batch of {B}; give one per row")
    for g in (generator if isinstance(generator, (list, tuple)) else [generator]):
        if g is not None and not isinstance(g, torch.Generator):
            raise InputError(f"generator must be a torch.Generator or a list of them (one per row), got "
                             f"{type(g).__name__}; for a seed make one with torch.Generator(device={dev.type!r})"
                             ".manual_seed(seed)")
        if g is not None and g.device.type != dev.type:
            raise InputError(f"the generator is on {g.device.type} but the model is on {dev}: the noise is drawn "
                             f"where the model runs; make it with torch.Generator(device={dev.type!r}).manual_seed(...)")
    if cache is not None and not isinstance(cache, KVCache):
        raise InputError(f"cache must be the KVCache of an earlier result (result.cache), got {type(cache).__name__}")
    if cache is not None and (why := module.cache_mismatch(cache)) is not None:
        raise InputError(f"cache is not this model's ({why}); pass the .cache of this model's own result")
    T_start = cache.length if cache is not None else 0
    n_canvases = math.ceil(cfg.max_new_tokens / C)
    limit = module.text.max_position_embeddings
    if T_start + S + n_canvases * C > limit:
        room = (limit - T_start - S) // C * C  # the whole canvases the prompt leaves
        fix = f"lower max_new_tokens to at most {room} or shorten the prompt" if room > 0 else "shorten the prompt"
        raise InputError(f"prompt ({T_start + S} tokens) + {n_canvases} canvas(es) of {C} exceeds "
                         f"max_position_embeddings={limit}; {fix}")
    if cache is not None and cache.batch != B:
        raise InputError(f"cache was built for batch {cache.batch}, got input batch {B}")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, S):
            raise InputError(f"attention_mask shape {list(attention_mask.shape)} must equal input_ids shape {[B, S]}")
        attention_mask = attention_mask.to(dev).bool()
        empty = (~attention_mask.any(dim=1)).nonzero().flatten().tolist() if cache is None else []
        if empty:
            raise InputError(f"attention_mask row {empty[0]} masks every token: a row needs at least one token of "
                             "prompt (1 = token, 0 = left padding)")
    if fixed_tokens is not None:
        fixed_tokens = _fixed_ids(fixed_tokens)
        if fixed_tokens.dim() != 2 or fixed_tokens.shape[0] != B:
            raise InputError(f"fixed_tokens must be [batch={B}, length], got shape {list(fixed_tokens.shape)}")
        if fixed_tokens.shape[1] > n_canvases * C:
            raise InputError(f"fixed_tokens spans {fixed_tokens.shape[1]} tokens but max_new_tokens="
                             f"{cfg.max_new_tokens} gives {n_canvases} canvas(es) of {C}; raise max_new_tokens")
        if fixed_tokens.numel() and (int(fixed_tokens.min()) < -2 or int(fixed_tokens.max()) >= V):
            raise InputError(f"fixed_tokens must hold ids in [0, {V}), -1 (free) or -2 (free, discarded)")
        pad_to = n_canvases * C - fixed_tokens.shape[1]
        fixed_tokens = torch.nn.functional.pad(fixed_tokens, (0, pad_to), value=-1).to(dev)
    return input_ids.to(dev), attention_mask, fixed_tokens, n_canvases, T_start


def _in_order(rows):
    """Index putting batch-order tensors back into the caller's row order, or None where they are in it."""
    order = [r.index for r in rows]
    if order == list(range(len(order))):
        return None
    return torch.tensor(order).argsort()


def stream(module, input_ids: torch.Tensor, cfg: GenerationConfig, canvas_length: int,
           attention_mask: torch.Tensor | None = None, generator: torch.Generator | None = None,
           cache: KVCache | None = None, decoder_input_ids: torch.Tensor | None = None,
           self_conditioning_logits: torch.Tensor | None = None, drafts: bool = True,
           fixed_tokens: torch.Tensor | None = None, options: Options | None = None, passes=None,
           constraints: list | None = None, logit_bias: dict | list | None = None):
    """Yield Draft / Commit events and a final Finished(result).

    input_ids [B, S]: the tokens not yet in `cache` (the whole prompt when cache is None).
    attention_mask [B, S] (1 = token, 0 = left padding) for those tokens.
    generator: None (global RNG), one torch.Generator, or a list of B generators (one per row).
    fixed_tokens [B, L] (infilling / editing in place): token ids the new tokens must hold, -1 where the
    model decides, -2 where it decides but the caller will discard the token; adaptive stopping then
    looks only at the -1 positions (columns past L count as -1). Canvas c holds columns [c*C, (c+1)*C) fixed
    from its first step to its commit. Random draws are unchanged, so fixing nothing (all -1) gives the same
    tokens as no `fixed_tokens`.
    options: how it runs (`blockpress.options.Options`; None: the defaults). Read here: `sampler` ("exact": the
    reference's arithmetic and draws; "fast": the fused one-pass sampler of kernels/sampler_fused.py, same
    distribution, another random stream, a pass per row with per-row generators), `fuse_commit` (encode each
    committed canvas in the same pass as the next canvas's first denoising step, `module.encode_decode`: one read
    of the weights instead of two; the same function up to fp32 summation order), `compact_rows` (run each step's
    decoder pass on the rows still denoising only, see `runner`; with one generator for the batch the sampler still
    runs on every row, so the random stream is the uncompacted loop's; None: on with per-row generators and B > 1,
    off with one generator, the reference's arithmetic batch for batch; under CUDA graphs it needs per-row
    generators).
    passes: the passes to run (`GraphedPasses` under CUDA graphs); None: the module's own.
    constraints: one `engine.constraint.Constraint` or `TokenBan` (or None) per row: the grammar the row's canvases
    obey, or the tokens they may not hold.
    logit_bias: {token id: value} added to a row's soft-capped logits before the temperature, every step
    (`sampling.bias_vector`; -100 bans a token, +100 forces it): one for every row, or a list with one (or None)
    per row.
    """
    ids, mask, fixed_tokens, n_canvases, T_start = _check(module, input_ids, cfg, canvas_length, attention_mask,
                                                          generator, cache, fixed_tokens)
    S = ids.shape[1]
    engine, rows = _engine(module, ids, mask, cfg, n_canvases, T_start, generator, cache, fixed_tokens,
                           options or Options(), passes, constraints, logit_bias)
    runner = engine.runner
    if decoder_input_ids is not None or self_conditioning_logits is not None:
        engine.first = (decoder_input_ids, self_conditioning_logits)
    seq, steps_per_canvas, canvas_seconds = ids, [], []
    t_start = time.perf_counter()
    prefill_seconds = first_commit = 0.0
    N = cfg.max_denoising_steps
    try:
        for c in range(n_canvases):
            for ev in engine.canvas():
                back = _in_order(ev.rows)
                order = (lambda t: t) if back is None else (lambda t, b=back: t[b.to(t.device)])  # noqa: E731
                if isinstance(ev, Admitted):
                    if ids.is_cuda:
                        torch.cuda.synchronize(ids.device)
                    prefill_seconds = time.perf_counter() - t_start
                elif isinstance(ev, Stepped):
                    if drafts:
                        yield Draft(c, ev.step, N, order(ev.tokens).cpu(), order(ev.accepted).cpu(),
                                    order(ev.done).cpu())
                elif isinstance(ev, Committed):
                    new = order(ev.tokens)
                    seq = torch.cat([seq, new], dim=-1)
                    steps_per_canvas.append(ev.steps)
                    canvas_seconds.append(ev.seconds)
                    if c == 0:
                        first_commit = time.perf_counter() - t_start
                    yield Commit(c, new.cpu(), order(torch.tensor(ev.finished)), ev.steps, ev.seconds)
            if all(r.finished for r in rows):
                break
    finally:  # also when the caller stops reading early: a cache of theirs must not stay in slot order
        if runner.cache is not None:
            runner.restore(engine.rows)
    new_tokens = seq[:, S:]
    pad = cfg.pad_token_id
    wrote = new_tokens != pad if pad is not None else torch.ones_like(new_tokens, dtype=torch.bool)
    if fixed_tokens is not None:  # held (given) and discarded (-2) positions are not the model's tokens
        wrote &= fixed_tokens[:, :new_tokens.shape[1]].to(new_tokens.device) == -1
    passes_t = torch.tensor([r.passes for r in rows], dtype=torch.int32, device=ids.device)
    if pad is None and fixed_tokens is None:  # every position counts: the reference's int over the passes (torch
        tpf = new_tokens.shape[1] / passes_t  # evaluates it as reciprocal * int, one rounding more: the same bits)
    else:
        tpf = wrote.sum(dim=-1) / passes_t
    yield Finished(GenerationResult(
        sequences=seq, tokens_per_forward=tpf, steps_per_canvas=steps_per_canvas,
        canvas_seconds=canvas_seconds, prompt_length=S, prefill_seconds=prefill_seconds,
        first_commit_seconds=first_commit, total_seconds=time.perf_counter() - t_start,
        forward_passes=passes_t, cache=runner.cache, config=cfg))


def seeded(seed, device) -> torch.Generator:
    """A generator on `device` seeded with `seed`, a whole number in -2**63..2**64 - 1 (else SamplingError; a negative
    one is seed + 2**64: `config.torch_seed`)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not MIN_SEED <= seed <= MAX_SEED:
        raise SamplingError(f"seed must be a whole number in {MIN_SEED}..{MAX_SEED}, got {seed!r}")
    return torch.Generator(device=device).manual_seed(torch_seed(seed))


def seed_or_generator(seed, generator, device) -> torch.Generator | None:
    """The random stream of a call that takes `seed=` and `generator=`: `generator`, else one seeded with `seed`
    (`seeded`), else None (torch's global generator); both given is a SamplingError (one would be ignored)."""
    if seed is not None and generator is not None:
        raise SamplingError("give seed or generator, not both (a generator is already seeded)")
    return generator if seed is None else seeded(seed, device)


def _biases(logit_bias, B: int, module) -> list:
    """Each row's logit bias vector (None: none) from one bias for the batch or a list of one per row."""
    V, dev = module.text.vocab_size, module.device
    if not isinstance(logit_bias, (list, tuple)):
        return [bias_vector(logit_bias, V, dev)] * B
    if len(logit_bias) != B:
        raise InputError(f"got {len(logit_bias)} logit biases for a batch of {B}; give one (or None) per row, or "
                         "one dict for every row")
    return [bias_vector(b, V, dev) for b in logit_bias]


def _engine(module, ids, mask, cfg, n_canvases: int, T_start: int, generator, cache, fixed_tokens,
            options: Options, passes, constraints, logit_bias=None):
    """The engine for one Python batch (every row admitted at once) and its rows."""
    B, S = ids.shape
    if constraints is not None and (len(constraints) != B or fixed_tokens is not None):
        raise InputError("constraints: one per row, and not together with fixed_tokens (infilling)")
    per_row = isinstance(generator, (list, tuple))
    graphed = hasattr(passes, "sc_buffer")  # CUDA graphs (or a wrapper of them): fixed buffers
    if options.compact_rows and graphed and not per_row:
        raise InputError("compact_rows=True with one generator cannot run on CUDA-graphed passes; give one "
                         "generator per row (generator=[...]), or generate without CUDA graphs")
    compact = per_row and B > 1 if options.compact_rows is None else bool(options.compact_rows)
    rows = [Row(cfg, n_canvases, index=i, prompt_length=S, generator=generator[i] if per_row else None,
                fixed=None if fixed_tokens is None else fixed_tokens[i],
                constraint=None if constraints is None else constraints[i], bias=bias)
            for i, bias in enumerate(_biases(logit_bias, B, module))]
    engine = Engine(Runner(module, passes, compact=compact), _Batch(Admission(rows, T_start + S, ids, mask, cache)),
                    options.sampler, options.fused(module.device), per_row, None if per_row else generator)
    return engine, rows


def generate(module, input_ids, cfg, canvas_length, **kwargs) -> GenerationResult:
    """Non-streaming generation: the same loop as `stream`, consumed to the end."""
    for event in stream(module, input_ids, cfg, canvas_length, drafts=False, **kwargs):
        if isinstance(event, Finished):
            return event.result
    raise RuntimeError("generation loop ended without a result")  # unreachable
