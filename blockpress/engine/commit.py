"""The commit rule: a denoised canvas becomes committed tokens, and rows end.

Shape legend: B rows, C canvas length.

For each row: the committed canvas is the argmax of its last executed step. The row's sequence ends at this
canvas when the canvas holds one of its stop ids (`eos_token_id`) or when it was the row's last canvas. With a
`pad_token_id`, every position after the first stop id becomes pad, and a row that ended at an earlier canvas
(it stays in a batch that shares one random stream) commits pad only. Without a pad id the tokens are left as
the model wrote them (the reference's behaviour).
"""

from __future__ import annotations

import torch

from .events import TokenLogprobs


def _stop_test(rows, device):
    """tokens [B, C] -> [B, C] bool, the token is one of its row's stop ids (`eos_token_id`); None where no row has
    any. One set for the whole batch (a Python batch) is `isin`, as the reference does."""
    ids = [tuple(r.cfg.eos_token_id or ()) for r in rows]
    if not any(ids):
        return None
    if len(set(ids)) == 1:
        one = torch.tensor(ids[0], dtype=torch.long, device=device)
        return lambda tokens: torch.isin(tokens, one)
    width = max(map(len, ids))
    stops = torch.tensor([list(i) + [-1] * (width - len(i)) for i in ids], dtype=torch.long, device=device)
    return lambda tokens: (tokens[:, :, None] == stops[:, None, :]).any(-1)


def commit(tokens: torch.Tensor, rows) -> tuple[torch.Tensor, list[bool]]:
    """tokens [B, C] (the last step's argmax) -> the committed canvas (a new tensor) and, per row, whether its
    sequence has ended. Reads `cfg.eos_token_id`, `cfg.pad_token_id`, `finished` (ended before) and
    `canvases_left` (this canvas included) of each row."""
    new = tokens.clone()
    stop_test = _stop_test(rows, new.device)
    is_stop = stop_test(new) if stop_test is not None else None
    ended = is_stop.any(dim=-1).tolist() if is_stop is not None else [False] * len(rows)
    ended = [e or r.canvases_left <= 1 for e, r in zip(ended, rows)]
    before = [r.finished for r in rows]
    pads = [r.cfg.pad_token_id for r in rows]
    if any(p is not None and (b or e) for p, b, e in zip(pads, before, ended)):
        pad = torch.tensor([p if p is not None else 0 for p in pads], dtype=new.dtype, device=new.device)
        has_pad = torch.tensor([p is not None for p in pads], device=new.device)
        gone = torch.tensor(before, device=new.device) & has_pad  # rows that ended before: pad only
        new = torch.where(gone[:, None], pad[:, None], new)
        if is_stop is not None and any(e and not b for e, b in zip(ended, before)):
            is_stop = stop_test(new)  # again: the pad written above may itself be a stop id
            seen = is_stop.cumsum(dim=-1)
            after = (seen > 0) & ~((seen == 1) & is_stop)  # every position after the first stop id
            new = torch.where(after & has_pad[:, None], pad[:, None], new)
    return new, [b or e for b, e in zip(before, ended)]


def token_logprobs(sc: torch.Tensor | None, tokens: torch.Tensor, rows) -> TokenLogprobs | None:
    """The committed tokens' log-probabilities for the rows whose job asked (`Job.logprobs` = k alternatives, 0:
    the chosen token's only; None: not asked), or None when no row asked. sc [B, C, V]: the canvas's
    self-conditioning logits after its last step (each row's last executed step's z = logits / tau, whose
    argmax is the committed canvas); tokens [B, C] the committed canvas. log_softmax(z.float()), one row at a
    time (a [C, V] fp32 buffer, not [B, C, V]); nothing is read back here, and rows that did not ask cost
    nothing."""
    want = [i for i, r in enumerate(rows)
            if getattr(r.job, "logprobs", None) is not None and not r.cancelled and not r.finished]
    if not want or sc is None:
        return None
    k = min(max(rows[i].job.logprobs for i in want), sc.shape[-1])
    values, ids = [], []
    for i in want:
        lp = torch.log_softmax(sc[i].float(), dim=-1)  # [C, V]
        chosen = lp.gather(-1, tokens[i][:, None].long())
        if k:
            top = lp.topk(k, dim=-1)
            values.append(torch.cat([chosen, top.values], dim=-1))
            ids.append(top.indices)
        else:
            values.append(chosen)
    return TokenLogprobs(want, torch.stack(values), torch.stack(ids) if k else None)
