"""Routing in one kernel: softmax, top-k, renormalisation and per-expert scale of the router's logits.

Shape legend: N tokens, E experts, K top-k (BE, BK: E and K rounded up to powers of two).

`model.moe.route_topk` (the reference) is about eight torch ops per layer (cast, softmax, top-k, sum, divide, gather,
cast, multiply), each a kernel launch on a GPU for a few kilobytes. `route_triton` does them in one program per
token: the row's E logits in fp32, softmax (max, exp, sum, divide), then K rounds of "take the largest logit",
renormalised over the K chosen probabilities and multiplied by their `per_expert_scale`. The router's projection
(a GEMM) and the norm before it stay torch ops (a compiled block fuses the norm).

Same function as the reference up to fp32 rounding: indices equal, weights within a few ulp (the softmax's sum and
exp are another implementation's). Ties: the kernel ranks by logit, and among equal logits the lower expert index
first. torch.topk leaves the order of equal values to its implementation (on a CPU it is neither index order nor
stable), so where two experts tie at the K-th place the two may route a token differently: both are a valid top-k.
Distinct logits whose fp32 probabilities round to the same value are ranked by logit here (torch ranks them as a
tie); in bf16 (a GPU's model dtype) distinct logits are ~2^-8 apart relatively, far from that.

`kernels.select` picks the kernel where the other Triton kernels run (a CUDA GPU: "triton_checked", compared with
the reference on its first call per device and dtype); everywhere else the reference runs. `route_op` is the
custom op a compiled block calls (kernels/library.py says why).
"""

from __future__ import annotations

import torch

from ..model.moe import route_topk
from ._triton import tl, triton
from .moe_grouped import checked_on_first_use

if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, scale_ptr, w_ptr, idx_ptr, E, stride_l, K: tl.constexpr, BE: tl.constexpr,
                      BK: tl.constexpr):
        """One token: w[k], idx[k] for k < K (descending logit, lower index first among equals)."""
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BE)
        emask = e < E
        z = tl.load(logits_ptr + row * stride_l + e, mask=emask, other=float("-inf")).to(tl.float32)
        ex = tl.exp(z - tl.max(z, 0))  # padding: exp(-inf) = 0
        p = ex / tl.sum(ex, 0)
        ks = tl.arange(0, BK)
        w = tl.zeros((BK,), dtype=tl.float32)
        idx = tl.zeros((BK,), dtype=tl.int32)
        taken = e >= E  # chosen experts (and the padding): a -inf logit among the top K must not choose one again
        for k in tl.static_range(K):
            best = tl.max(tl.where(taken, float("-inf"), z), 0)
            j = tl.min(tl.where(~taken & (z == best), e, BE), 0)  # the lowest index holding the largest logit left
            w = tl.where(ks == k, tl.sum(tl.where(e == j, p, 0.0), 0), w)
            idx = tl.where(ks == k, j, idx)
            taken = taken | (e == j)
        kmask = ks < K
        w = w / tl.sum(tl.where(kmask, w, 0.0), 0)
        w = w * tl.load(scale_ptr + idx, mask=kmask, other=0.0).to(tl.float32)
        tl.store(w_ptr + row * K + ks, w, mask=kmask)
        tl.store(idx_ptr + row * K + ks, idx.to(tl.int64), mask=kmask)


def route_triton(logits_NE: torch.Tensor, per_expert_scale_E: torch.Tensor, top_k: int):
    """`route_topk` in one Triton kernel: weights [N, K] fp32, indices [N, K] int64."""
    if triton is None:
        raise RuntimeError("route_triton needs triton (pip install triton)")
    N, E = logits_NE.shape
    if logits_NE.stride(-1) != 1:
        logits_NE = logits_NE.contiguous()
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits_NE.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits_NE.device)
    if N:
        _route_kernel[(N,)](logits_NE, per_expert_scale_E, w, idx, E, logits_NE.stride(0), K=top_k,
                            BE=triton.next_power_of_2(E), BK=triton.next_power_of_2(top_k))
    return w, idx


def route_triton_checked(logits_NE: torch.Tensor, per_expert_scale_E: torch.Tensor, top_k: int):
    """`route_triton`, checked against the reference on its first call per device and dtype: the routing weight of
    every (token, expert), so a different index shows as a large error."""
    args = (logits_NE, per_expert_scale_E, top_k)
    N, E = logits_NE.shape

    def dense(route) -> torch.Tensor:  # weights [N, K] at their indices -> [N, E]
        return torch.zeros(N, E, dtype=torch.float32, device=logits_NE.device).scatter_(1, route[1], route[0])

    key = (str(logits_NE.device), str(logits_NE.dtype).removeprefix("torch."), "triton routing", (top_k,))
    return checked_on_first_use(key, lambda: route_triton(*args), lambda: route_topk(*args), "the Triton routing kernel",
                                as_tensor=dense)


ROUTE = {"torch": route_topk, "triton": route_triton, "triton_checked": route_triton_checked}


@torch.library.custom_op("blockpress::route", mutates_args=())
def route_op(logits_NE: torch.Tensor, per_expert_scale_E: torch.Tensor, top_k: int,
             kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`ROUTE[kernel]` as one opaque call in a compiled graph."""
    return ROUTE[kernel](logits_NE, per_expert_scale_E, top_k)


@route_op.register_fake
def _(logits_NE, per_expert_scale_E, top_k, kernel):
    N = logits_NE.shape[0]
    return (logits_NE.new_empty(N, top_k, dtype=torch.float32), logits_NE.new_empty(N, top_k, dtype=torch.int64))
