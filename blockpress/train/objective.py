"""The DiffusionGemma training objective: corruption, batch layout, loss.

Shape legend: B batch, S clean sequence length, C canvas length, V vocab, T decoder context length.

Per example (one (prompt, response) pair), with its own RNG derived from (seed, step, example index)
so that data-parallel ranks and resumed runs draw exactly the same noise:
- the response is cut into canvases of C tokens measured from its first token; the last one is
  EOS-filled; one canvas `b` is selected uniformly (Google's way);
- t ~ U[eps, 1); each canvas position keeps its clean token with prob 1 - t, otherwise takes a token
  drawn uniformly from the whole vocabulary [0, V) (no mask token);
- optionally (`swap_rate` > 0, off by default: an addition to the spec) each position that kept its clean
  token is, with prob `swap_rate`, overwritten by the clean token of a random position of the same canvas.
  With a large vocabulary, uniform noise almost never looks like data (a Sudoku canvas has 9 digits among
  826 ids), so a decoder trained on it alone learns that a plausible token is always right and copies it
  with probability ~1; swapped tokens are plausible but wrong, which teaches it to revise them;
- a self-conditioning coin with probability `sc_prob`.

Batch layout (the leakage rule): every row is left-padded so that the selected canvas's
context (prompt + clean canvases < b) ends at the same position T for all rows:
`[pad .. pad | prompt | canvas 0 .. canvas b-1 | canvas b (clean) | later canvases | pad ..]`.
One causal encoder pass over the clean rows gives the AR logits and the K/V cache; the cache is then
cropped to T, so the decoder (queries at positions T + j) sees the prompt and earlier canvases but
never the clean copy of the canvas it denoises, nor any later canvas. RoPE is relative, so the per-row
left-padding offset does not change any attention score.

Loss: L = w_diff * mean_b[ mean_j CE(decoder logits, clean canvas) over every canvas
position, corrupted or not, EOS fill included ] + w_ar * mean_b[ mean CE of the encoder's next-token
prediction over scored targets ] where the AR targets are the response tokens (`ar_scope="response"`,
[RH]/[MB]) or every valid token after the first (`"all"`, [G-SFT]). Decoder pass 1 runs without
gradient and zero self-conditioning; pass 2 uses softmax(pass-1 logits) as the SC signal for rows whose
coin is on, a zero *embedding* (sc_mask False) for the others. Prompt positions never get diffusion loss.

Rollout rows (`rollout_step`): pass 1's logits z, at a temperature tau ~ U[0.4, 0.8] (the release's
schedule range), give what one inference step would: a sample y ~ softmax(z / tau) at the positions the
entropy bound accepts (a per-row bound, log-uniform in [1e-2, 1e2], from a few tokens to the whole canvas),
fresh uniform noise elsewhere. Pass 2 reads that canvas with z / tau as its
self-conditioning input (what the next inference step gets) and is scored against the clean canvas as
usual. Its errors are the model's own plausible mistakes, accepted as confidently as the sampler would
accept them, which is what the decoder must take back at inference. Held positions stay clean. The draws
(coin, tau, bound, one uniform per position for inverse-CDF sampling, the noise) are made in `collate`
from the example's generator, after every other draw, so resumed and data-parallel runs agree and a run
with rollout 0 draws exactly what it did before.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ObjectiveConfig:
    eps: float = 1e-3  # t ~ U[eps, 1)
    sc_prob: float = 0.5  # self-conditioning probability per example
    diffusion_weight: float = 1.0  # >= 0
    ar_weight: float = 1.0  # encoder next-token loss, >= 0 (0 disables the encoder loss)
    ar_scope: str = "response"  # "response": targets are response tokens; "all": every valid token
    seed: int = 0
    ar_only: bool = False  # baseline: plain causal LM (no decoder passes)
    swap_rate: float = 0.0  # prob. that a kept position takes another position's clean token (0: spec objective)
    rollout: float = 0.0  # prob. that an example is denoised from one step of the model's own sampler (0: spec)

    def __post_init__(self):
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"eps must be in [0, 1), got {self.eps}")
        if not 0.0 <= self.sc_prob <= 1.0:
            raise ValueError(f"sc_prob must be in [0, 1], got {self.sc_prob}")
        if self.ar_scope not in ("response", "all"):
            raise ValueError(f"ar_scope must be 'response' or 'all', got {self.ar_scope!r}")
        if not 0.0 <= self.swap_rate <= 1.0:
            raise ValueError(f"swap_rate must be in [0, 1], got {self.swap_rate}")
        if not 0.0 <= self.rollout <= 1.0:
            raise ValueError(f"rollout must be in [0, 1], got {self.rollout}")
        for name in ("ar_weight", "diffusion_weight"):  # nan / inf / < 0: a loss that cannot train (or un-trains)
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {w}")
        if not self.ar_only and self.ar_weight == 0 and self.diffusion_weight == 0:
            raise ValueError("ar_weight and diffusion_weight are both 0: the loss is 0, nothing would be learnt; give "
                             "one of them a weight > 0")


OBJECTIVE_FILE = "blockpress_objective.json"  # in every checkpoint the trainer writes: the loss it trained with


def objective_record(cfg: ObjectiveConfig) -> str:
    """The OBJECTIVE_FILE of a run with this objective (its fields but the data seed)."""
    return json.dumps({k: v for k, v in asdict(cfg).items() if k != "seed"}, indent=2)


def trained_ar_weight(folder: str | Path | None) -> float | None:
    """The encoder next-token loss weight a model folder says it was trained with (its OBJECTIVE_FILE), or None
    where it says nothing. A fine-tune defaults to it: a model trained with the loss off has an encoder head that
    never learned the next token, and turning the loss on makes that untrained term lead the update. A damaged file
    is an InputError naming it."""
    from ..errors import InputError

    f = Path(folder) / OBJECTIVE_FILE if folder is not None else None
    if f is None or not f.is_file():
        return None
    try:
        w = json.loads(f.read_text(encoding="utf-8")).get("ar_weight")
        if w is not None:
            ObjectiveConfig(ar_weight=w)  # its own rule for the weight (a finite number >= 0)
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
        raise InputError(f'{f} must be a JSON object whose "ar_weight" is a number >= 0 (the objective the model was '
                         'trained with, e.g. {"ar_weight": 0}); fix it, or delete it and give --ar-weight') from None
    return None if w is None else float(w)


def example_generator(seed: int, step: int, index: int, stream: str = "train") -> torch.Generator:
    """A CPU generator that depends only on (seed, step, global example index, stream name)."""
    h = hashlib.blake2b(f"{stream}/{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))


def corrupt(x0: torch.Tensor, t: torch.Tensor, vocab_size: int, generator: torch.Generator | None = None,
            held: torch.Tensor | None = None, swap_rate: float = 0.0):
    """Uniform-state corruption. x0 [..., C] ids, t [...] -> (x_t, replaced [..., C] bool).

    Each position is replaced with prob t by a token uniform over [0, V) (which may equal the original).
    held [..., C] bool: positions that stay clean whatever t is (infill training: the given context
    on the canvas, as `fixed_tokens` holds it at inference). The random draws do not depend on it.
    swap_rate: each position not replaced (nor held) then takes, with this prob, the clean token of a
    position drawn uniformly from the same canvas (in-distribution errors; counted in `replaced`). At
    0 nothing more is drawn, so the generator's stream is the plain objective's."""
    u = torch.rand(x0.shape, generator=generator)
    replaced = u < t.unsqueeze(-1)
    if held is not None:
        replaced &= ~held
    noise = torch.randint(0, vocab_size, x0.shape, generator=generator)
    x = torch.where(replaced, noise, x0)
    if swap_rate > 0:
        swap = torch.rand(x0.shape, generator=generator) < swap_rate
        src = torch.randint(0, x0.shape[-1], x0.shape, generator=generator)
        swap &= ~replaced if held is None else ~(replaced | held)
        x = torch.where(swap, x0.gather(-1, src), x)
        replaced = replaced | swap
    return x, replaced


def split_canvases(response: list[int], C: int, eos_id: int, max_canvases: int | None = None) -> list[list[int]]:
    """Response-relative chunks of C tokens; the last one EOS-filled."""
    if not response:
        raise ValueError("empty response: nothing to supervise")
    n = -(-len(response) // C)
    if max_canvases is not None:
        n = min(n, max_canvases)
    filled = list(response[: n * C]) + [eos_id] * (n * C - min(len(response), n * C))
    return [filled[i * C:(i + 1) * C] for i in range(n)]


COUNTS = "counts"  # the stats' key for how many positions each accuracy counts: pooled, not averaged, across ranks
ROLLOUT_TAU = (0.4, 0.8)  # temperature range of the release's schedule (t_min, t_max)
ROLLOUT_LOG10_BOUND = (-2.0, 2.0)  # entropy bound of a rollout step, log-uniform: a few tokens .. all


@dataclass
class RolloutDraws:
    """Per-example random draws of a rollout step (made in `collate`, used after decoder pass 1)."""
    coin: torch.Tensor  # [B] bool: this row learns from a rollout canvas
    tau: torch.Tensor  # [B] sampling temperature
    bound: torch.Tensor  # [B] entropy bound of the acceptance
    u: torch.Tensor  # [B,C] uniforms in [0, 1): inverse-CDF sample per position
    noise: torch.Tensor  # [B,C] uniform tokens for the positions not accepted

    def to(self, device) -> "RolloutDraws":
        return RolloutDraws(**{k: v.to(device) for k, v in vars(self).items()})


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B,S] clean rows (left/right padded with pad_id)
    valid: torch.Tensor  # [B,S] bool, real tokens
    ar_target: torch.Tensor  # [B,S] bool, positions whose token is an AR target (predicted from j-1)
    ctx_len: int  # T: decoder context length (same for all rows)
    canvas_clean: torch.Tensor  # [B,C] the selected canvas (diffusion targets)
    canvas_noisy: torch.Tensor  # [B,C] x_t
    replaced: torch.Tensor  # [B,C] bool, positions that were re-drawn
    t: torch.Tensor  # [B] corruption level
    sc_mask: torch.Tensor  # [B] bool, self-conditioning on
    scored: torch.Tensor | None = None  # [B,C] bool, positions with diffusion loss (None: all)
    rollout: RolloutDraws | None = None  # cfg.rollout > 0 only
    ar_from: int = 0  # the first position any row's AR target sits at (the AR logits are made from the one before)
    fill: torch.Tensor | None = None  # [B,C] bool, the EOS fill after the response (None: not known)

    def to(self, device) -> "TrainBatch":
        return TrainBatch(**{k: (v.to(device) if isinstance(v, (torch.Tensor, RolloutDraws)) else v)
                             for k, v in vars(self).items()})

    @property
    def n_tokens(self) -> int:
        return int(self.valid.sum())


def collate(examples: list[tuple[list[int], list[int]]], C: int, vocab_size: int, cfg: ObjectiveConfig,
            step: int, first_index: int = 0, eos_id: int = 1, pad_id: int = 0,
            max_canvases: int | None = None, stream: str = "train") -> TrainBatch:
    """(prompt ids, response ids) pairs -> TrainBatch. Example k uses the RNG of global index first_index + k.

    An example may be a triple (prompt, response, held): held is one bool per response token (True: the
    token is given context on the canvas, never corrupted and never scored; infill training). Tokens
    of the EOS fill are free."""
    rows, sel, ts, xt, rep, clean, sc, scored, roll, fill = [], [], [], [], [], [], [], [], [], []
    any_held = False
    for k, ex in enumerate(examples):
        prompt, response = ex[0], ex[1]
        held_tokens = ex[2] if len(ex) > 2 else None
        if held_tokens is not None and len(held_tokens) != len(response):
            raise ValueError(f"example {first_index + k}: held has {len(held_tokens)} flags for "
                             f"{len(response)} response tokens")
        g = example_generator(cfg.seed, step, first_index + k, stream)
        canv = split_canvases(response, C, eos_id, max_canvases)
        b = int(torch.randint(0, len(canv), (1,), generator=g))
        t = cfg.eps + (1.0 - cfg.eps) * torch.rand((), generator=g)
        x0 = torch.tensor(canv[b])
        held = torch.zeros(C, dtype=torch.bool)
        if held_tokens is not None:
            part = [bool(v) for v in held_tokens[b * C:(b + 1) * C]]
            held[:len(part)] = torch.tensor(part, dtype=torch.bool)
            any_held |= bool(held.any())
        x, r = corrupt(x0, t, vocab_size, g, held, cfg.swap_rate)
        scored.append(~held)
        coin = bool(torch.rand((), generator=g) < cfg.sc_prob)
        if cfg.rollout > 0:  # drawn last: the draws above are the same with or without rollout
            roll.append(_rollout_draws(g, cfg.rollout, C, vocab_size))
        rows.append((list(prompt), [tok for c in canv for tok in c]))
        fill.append(torch.arange(b * C, (b + 1) * C) >= len(response))
        sel.append(b)
        ts.append(t)
        xt.append(x)
        rep.append(r)
        clean.append(x0)
        sc.append(coin)
    ctx = [len(p) + b * C for (p, _), b in zip(rows, sel)]
    T = max(ctx)
    lefts = [T - c for c in ctx]
    S = max(lft + len(p) + len(r) for lft, (p, r) in zip(lefts, rows))
    B = len(rows)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    valid = torch.zeros(B, S, dtype=torch.bool)
    target = torch.zeros(B, S, dtype=torch.bool)
    for i, (lft, (p, r)) in enumerate(zip(lefts, rows)):
        n = len(p) + len(r)
        ids[i, lft:lft + n] = torch.tensor(p + r, dtype=torch.long)
        valid[i, lft:lft + n] = True
        lo = lft + (len(p) if cfg.ar_scope == "response" else 1)
        target[i, max(lo, lft + 1):lft + n] = True  # never the first token of a row (nothing predicts it)
    rollout = RolloutDraws(*(torch.stack(parts) for parts in zip(*roll))) if roll else None
    cols = target.any(0)
    return TrainBatch(ids, valid, target, T, torch.stack(clean), torch.stack(xt), torch.stack(rep),
                      torch.stack(ts).float(), torch.tensor(sc, dtype=torch.bool),
                      torch.stack(scored) if any_held else None, rollout,
                      ar_from=int(cols.long().argmax()) if bool(cols.any()) else S, fill=torch.stack(fill))


def _rollout_draws(g: torch.Generator, rate: float, C: int, vocab_size: int) -> tuple[torch.Tensor, ...]:
    coin = torch.rand((), generator=g) < rate
    lo, hi = ROLLOUT_TAU
    tau = lo + (hi - lo) * torch.rand((), generator=g)
    blo, bhi = ROLLOUT_LOG10_BOUND
    bound = 10.0 ** (blo + (bhi - blo) * torch.rand((), generator=g))
    return coin, tau, bound, torch.rand(C, generator=g), torch.randint(0, vocab_size, (C,), generator=g)


def _per_example_mean(ce: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ce, mask [B,N] -> mean over examples (that have any scored token) of their mean CE."""
    m = mask.to(ce.dtype)
    count = m.sum(1)
    per = (ce * m).sum(1) / count.clamp(min=1)
    has = count > 0
    return per[has].mean() if bool(has.any()) else ce.sum() * 0.0


def encoder_pass(module, batch: TrainBatch, context_only: bool = False):
    """Causal encoder over the clean rows. Returns (final-normed hidden states [B,S,H], cache filled to S).

    context_only: encode only the decoder's context [0, T) and return (None, cache filled to T): the
    same cache the decoder reads after cropping (causal attention: positions < T never see later
    tokens), without the work on the clean canvases that only the AR loss needs."""
    ids, valid = batch.input_ids, batch.valid
    if context_only:
        ids, valid = ids[:, :batch.ctx_len], valid[:, :batch.ctx_len]
    B, S = ids.shape
    cache = module.new_cache(B, S, ring=False)  # cropped back to the context below: keep every position
    pad = None if bool(valid.all()) else valid
    h = module.encode(ids, cache, pad_mask=pad, output=not context_only)
    return h, cache


def ar_loss(module, h: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """Per-example mean next-token CE over `ar_target` positions (token j predicted from j-1), from the encoder's
    hidden states h [B,S,H]. Logits are made only from position `batch.ar_from` - 1 on: with the default scope
    (the response) that leaves out the prompt, whose [S, V] fp32 logits and soft-cap would be most of the AR loss's
    memory (on the 26B model, 1.34 GB per copy at a 1,024-token prompt + one canvas) and work."""
    lo = max(batch.ar_from - 1, 0)
    logits = module.lm_logits(h[:, lo:-1])  # [B, S-1-lo, V] fp32
    B, n, V = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, V), batch.input_ids[:, lo + 1:].reshape(-1), reduction="none").view(B, n)
    return _per_example_mean(ce, batch.ar_target[:, lo + 1:])


def rollout_step(z_raw: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the inference sampler from pass 1's raw logits, for the rollout rows.

    z_raw [B,C,V] -> (decoder input canvas [B,C], self-conditioning logits [B,C,V], sc_mask [B]); rows
    whose coin is off get x_t, z_raw and their own SC coin back unchanged. Rollout rows always get
    self-conditioning, as every inference step after the first does. Held positions stay clean."""
    from blockpress.sampling import entropy_bound_accept, token_entropy

    r = batch.rollout
    z = z_raw.float() / r.tau.to(torch.float32)[:, None, None]
    cdf = torch.softmax(z, dim=-1).cumsum(-1)  # [B,C,V]
    y = torch.searchsorted(cdf, r.u.to(cdf.dtype).unsqueeze(-1)).squeeze(-1).clamp(max=z.shape[-1] - 1)
    acc = entropy_bound_accept(token_entropy(z), r.bound.to(torch.float32)[:, None])
    x = torch.where(acc, y, r.noise)
    if batch.scored is not None:
        x = torch.where(batch.scored, x, batch.canvas_clean)
    on = r.coin[:, None]
    return (torch.where(on, x, batch.canvas_noisy), torch.where(on[..., None], z.to(z_raw.dtype), z_raw),
            batch.sc_mask | r.coin)


def decoder_inputs(module, batch: TrainBatch, cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Crop the cache to the context and run the detached pass 1 -> pass 2's (canvas, SC logits, SC mask)."""
    cache.crop(batch.ctx_len)  # the decoder reads cache positions [0, T): no clean canvas b or later
    with torch.no_grad():
        sc_logits = module.decode(batch.canvas_noisy, cache)  # pass 1: zero SC, whole batch always
        if batch.rollout is not None and bool(batch.rollout.coin.any()):
            return rollout_step(sc_logits, batch)
    return batch.canvas_noisy, sc_logits, batch.sc_mask


def decoder_logits(module, batch: TrainBatch, cache) -> torch.Tensor:
    """Pass 1 (detached, `decoder_inputs`), then pass 2 with its self-conditioning. -> [B,C,V] fp32."""
    canvas, sc_logits, sc_mask = decoder_inputs(module, batch, cache)
    return module.decode(canvas, cache, sc_logits=sc_logits, sc_mask=sc_mask)


def diffusion_loss(logits: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    B, C, V = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, V), batch.canvas_clean.reshape(-1), reduction="none").view(B, C)
    scored = batch.scored if batch.scored is not None else torch.ones_like(batch.canvas_clean, dtype=torch.bool)
    return _per_example_mean(ce, scored)


class TwoBackwards:
    """The step's backward as two: the decoder's, then the encoder's (`compute_loss(split=True)`).

    The encoder and the decoder run the same layers, so in one backward autograd sums each weight's two gradients in
    its input buffer before the weight's gradient is accumulated: every layer's decoder-pass gradient is held, whole,
    until the encoder's backward reaches that layer (one unsharded copy of all the gradients at once). Split at the
    K/V cache (the decoder reads the encoder's K/V as new leaf tensors), the decoder's backward finishes each layer's
    gradient as it goes, and FSDP2 reduce-scatters it into the layer's shard at once; the encoder's backward then
    carries the K/V gradients (and the AR loss) down through the encoder and adds its share. The same gradients up to
    fp32 summation order."""

    def __init__(self, decoder_loss: torch.Tensor, ar_loss: torch.Tensor | None, kv: list):
        self.decoder_loss, self.ar_loss, self.kv = decoder_loss, ar_loss, kv

    def scaled(self, factor: float) -> "TwoBackwards":
        """The same two backwards of `factor` x the loss (a micro-batch's share of a gradient-accumulation step; the
        K/V gradients the encoder's backward carries come from the scaled decoder loss)."""
        return TwoBackwards(self.decoder_loss * factor, None if self.ar_loss is None else self.ar_loss * factor,
                            self.kv)

    def decoder(self) -> None:
        self.decoder_loss.backward()

    def encoder(self) -> None:
        outs = [orig for orig, leaf in self.kv if leaf.grad is not None]
        grads = [leaf.grad for _, leaf in self.kv if leaf.grad is not None]
        if self.ar_loss is not None:
            outs.append(self.ar_loss)
            grads.append(torch.ones_like(self.ar_loss))
        if outs:
            torch.autograd.backward(outs, grads)
        self.kv = []


def _cut(cache) -> list:
    """Give the decoder the encoder's K/V as new leaves (sharing storage): [(encoder's tensor, decoder's leaf)]."""
    pairs = []
    for store in (cache.keys, cache.values):
        for i, t in enumerate(store):
            if t.requires_grad:
                store[i] = t.detach().requires_grad_(True)
                pairs.append((t, store[i]))
    return pairs


def compute_loss(module, batch: TrainBatch, cfg: ObjectiveConfig, split: bool = False):
    """The full objective on one (micro-)batch. Returns (loss, float stats for logging); with split, also the
    `TwoBackwards` to run instead of loss.backward() (what FSDP2 needs to shard each gradient as it is made)."""
    skip_ar = not cfg.ar_only and not cfg.ar_weight
    h, cache = encoder_pass(module, batch, context_only=skip_ar)
    l_ar = torch.zeros(()) if skip_ar else ar_loss(module, h, batch)
    if cfg.ar_only:
        stats = {"loss": float(l_ar.detach()), "ar": float(l_ar.detach())}
        return (l_ar, stats, TwoBackwards(l_ar, None, [])) if split else (l_ar, stats)
    kv = _cut(cache) if split else []
    canvas, sc_logits, sc_mask = decoder_inputs(module, batch, cache)
    logits = module.decode(canvas, cache, sc_logits=sc_logits, sc_mask=sc_mask)
    l_diff = diffusion_loss(logits, batch)
    loss = cfg.diffusion_weight * l_diff + (cfg.ar_weight * l_ar if cfg.ar_weight else 0.0)
    with torch.no_grad():
        correct = logits.argmax(-1) == batch.canvas_clean
        # positions the decoder had to change: x_t's re-drawn ones, or a rollout canvas's wrong ones
        wrong = batch.replaced if canvas is batch.canvas_noisy else canvas != batch.canvas_clean
        acc_noisy = correct[wrong].float().mean() if bool(wrong.any()) else torch.tensor(1.0)
        acc = correct[batch.scored] if batch.scored is not None else correct  # held positions are given
        # acc and acc_replaced count the EOS fill after a short response, which is trivially right (a 12-token
        # answer on a 32-token canvas is 20 fill positions): acc_text is acc_replaced on the response's own tokens
        text = wrong if batch.fill is None else wrong & ~batch.fill
        acc_text = correct[text].float().mean() if bool(text.any()) else torch.tensor(1.0)
    stats = {"loss": float(loss.detach()), "diff": float(l_diff.detach()), "ar": float(l_ar.detach()),
             "acc": float(acc.float().mean()), "acc_replaced": float(acc_noisy), "acc_text": float(acc_text),
             # the positions each ratio counts: ranks and eval batches pool them (distributed.reduce_stats)
             COUNTS: {"acc": acc.numel(), "acc_replaced": int(wrong.sum()), "acc_text": int(text.sum())}}
    if not split:
        return loss, stats
    ar = cfg.ar_weight * l_ar if cfg.ar_weight and not skip_ar else None
    return loss, stats, TwoBackwards(cfg.diffusion_weight * l_diff, ar, kv)


class ObjectiveModule(nn.Module):
    """`compute_loss` as a module forward, so DDP or FSDP2 can wrap the whole step (distributed.wrap)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: TrainBatch, cfg: ObjectiveConfig, split: bool = False):
        return compute_loss(self.module, batch, cfg, split=split)
