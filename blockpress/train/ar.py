"""The autoregressive baseline: the same DiffusionGemma backbone used as a plain causal LM.

Training uses `ObjectiveConfig(ar_only=True)` (the encoder's next-token loss on the clean
[prompt; response], no decoder passes). Decoding is greedy with the KV cache: encode the prompt,
then one token per forward through the encoder pass only.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_generate(module, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """prompt_ids [B,T] (no padding) -> new tokens [B, max_new_tokens] (argmax, never stops early)."""
    B, T = prompt_ids.shape
    cache = module.new_cache(B, T + max_new_tokens)
    h = module.encode(prompt_ids, cache)
    out = []
    for _ in range(max_new_tokens):
        nxt = module.lm_logits(h[:, -1]).argmax(-1)  # [B]
        out.append(nxt)
        if len(out) < max_new_tokens:
            h = module.encode(nxt[:, None], cache)
    return torch.stack(out, 1)


@torch.no_grad()
def greedy_until(module, prompt_ids: list[int], max_new_tokens: int, stop_ids, device=None) -> list[int]:
    """One prompt -> greedy new tokens, up to and including the first stop id (at most max_new_tokens)."""
    stops = set(stop_ids or ())
    ids = torch.tensor([prompt_ids], device=device)
    cache = module.new_cache(1, len(prompt_ids) + max_new_tokens)
    h = module.encode(ids, cache)
    out: list[int] = []
    while len(out) < max_new_tokens:
        nxt = module.lm_logits(h[:, -1]).argmax(-1)  # [1]
        out.append(int(nxt))
        if out[-1] in stops:
            break
        h = module.encode(nxt[:, None], cache)
    return out


def sudoku_solver(lm):
    """puzzles -> 81-digit predictions with greedy AR decoding (for sudoku.evaluate)."""
    from ..tasks import sudoku as sd

    def solve(puzzles):
        ids = torch.tensor([sd.encode_prompt(p) for p in puzzles], device=lm.device)
        new = greedy_generate(lm.module, ids, sd.N_CELLS)
        return [sd.decode_answer(row).ljust(sd.N_CELLS, "0") for row in new]
    return solve
