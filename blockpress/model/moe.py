"""Mixture of experts: router and experts.

Shape legend: N tokens (flattened B*S), H hidden, E experts, K top-k, Im expert intermediate size.

Router: consumes the raw residual, RMS-normalises it without weight, multiplies by `scale` and
H^-1/2, projects to E logits; then (`route_topk`, the reference; kernels/route.py fuses it) softmax in
fp32 before top-k, renormalises to sum 1, then multiplies by `per_expert_scale`. Experts: `gate_up_proj` [E, 2*Im, H] (gate first), `down_proj` [E, H, Im].
Expert contributions are weighted in fp32 and summed in fp32, cast once to the model dtype
(the reference's default grouped_mm accumulation).

Two expert implementations compute the same function (kernels/ has faster ones):
- `experts_loop` (reference): per expert, gather its tokens, two matmuls, scatter-add.
- `experts_dense` (when every expert is busy, e.g. a 256-token canvas with top-8):
  batched matmuls over all experts on the tokens routed to each, padded to equal counts.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import gelu_tanh, rms_norm


class Router(nn.Module):
    """The router's weights. `kernel(logits, per_expert_scale, top_k)` turns the projection's logits into the
    routing: `route_topk` (the reference) unless `kernels.select` chose another (kernels/route.py: one Triton kernel,
    the same function up to fp32 rounding)."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(hidden, n_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(n_experts))
        self.top_k, self.eps, self.hidden = top_k, eps, hidden
        self.kernel = route_topk

    def forward(self, r_NH: torch.Tensor):
        """r [N, H] raw residual -> weights [N, K] fp32, indices [N, K]."""
        n = rms_norm(r_NH, None, self.eps)
        n = n * self.scale * (self.hidden ** -0.5)
        return self.kernel(self.proj(n), self.per_expert_scale, self.top_k)


def route_topk(logits_NE: torch.Tensor, per_expert_scale_E: torch.Tensor, top_k: int):
    """Reference routing: softmax of the logits [N, E] in fp32, the top-k, renormalised to sum 1, times the chosen
    experts' `per_expert_scale` -> weights [N, K] fp32, indices [N, K] int64."""
    probs = torch.softmax(logits_NE.float(), dim=-1)  # [N, E] fp32
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    w = w * per_expert_scale_E[idx].float()
    return w, idx


def experts_loop(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI, counts=None):
    """Reference: loop over experts that received tokens. counts: tokens per expert (a list; None: counted from
    the routing; the training-memory model passes its own, as meta tensors carry no routing)."""
    N, H = x_NH.shape
    Im = down_EHI.shape[-1]
    out = torch.zeros(N, H, dtype=torch.float32, device=x_NH.device)
    flat_idx = idx_NK.reshape(-1)  # [N*K]
    order = torch.argsort(flat_idx, stable=True)
    if counts is None:
        counts = torch.bincount(flat_idx, minlength=gate_up_EFH.shape[0]).tolist()
    tok = order // idx_NK.shape[1]  # token of each sorted assignment
    wts = w_NK.reshape(-1)[order]
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        t = tok[start:start + c]
        u = x_NH[t] @ gate_up_EFH[e].t()  # [c, 2*Im]
        a = gelu_tanh(u[:, :Im]) * u[:, Im:]
        y = a @ down_EHI[e].t()  # [c, H]
        out.index_add_(0, t, y.float() * wts[start:start + c, None])
        start += c
    return out.to(x_NH.dtype)


def experts_dense(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI):
    """Batched path: tokens grouped per expert into a padded [E, M, H] block, two bmm calls."""
    N, H = x_NH.shape
    E, _, Im = down_EHI.shape
    K = idx_NK.shape[1]
    flat_idx = idx_NK.reshape(-1)
    order = torch.argsort(flat_idx, stable=True)
    counts = torch.bincount(flat_idx, minlength=E)
    M = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    sorted_e = flat_idx[order]
    slot = torch.arange(order.numel(), device=x_NH.device) - starts[sorted_e]  # position within expert
    tok = order // K
    xin = x_NH.new_zeros(E, M, H)
    xin[sorted_e, slot] = x_NH[tok]  # [E, M, H]
    u = torch.bmm(xin, gate_up_EFH.transpose(1, 2))  # [E, M, 2*Im]
    a = gelu_tanh(u[..., :Im]) * u[..., Im:]
    y = torch.bmm(a, down_EHI.transpose(1, 2))  # [E, M, H]
    contrib = y[sorted_e, slot].float() * w_NK.reshape(-1)[order, None]
    out = torch.zeros(N, H, dtype=torch.float32, device=x_NH.device)
    out.index_add_(0, tok, contrib)
    return out.to(x_NH.dtype)


class Experts(nn.Module):
    """The experts' weights. `kernel(x, w, idx, gate_up, down)` computes them: `experts_loop` (the reference) unless
    `kernels.select` chose another (the same function up to fp32 summation order; for a compiled block, a custom op
    that a traced graph holds as one call, kernels/library.py)."""

    def __init__(self, hidden: int, n_experts: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, inter))
        self.kernel = experts_loop

    def forward(self, x_NH, w_NK, idx_NK):
        return self.kernel(x_NH, w_NK, idx_NK, self.gate_up_proj, self.down_proj)
