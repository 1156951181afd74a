"""kernels/route.py: the one-kernel routing (softmax, top-k, renormalise, per-expert scale) against the torch
reference `model.moe.route_topk` (Triton's interpreter on a CPU)."""

import warnings

import pytest
import torch

from blockpress.kernels import moe_grouped
from blockpress.kernels.route import route_op, route_triton, route_triton_checked
from blockpress.model.moe import route_topk

from kernel_device import DEV, needs_triton

pytestmark = [pytest.mark.no_grad, needs_triton]


def _logits(N, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(N, E, generator=g) * 2).to(dtype)
    return z.to(DEV), (torch.rand(E, generator=g) + 0.5).to(DEV)


@pytest.mark.parametrize("N,E,K", [(1, 8, 3), (37, 128, 8), (5, 6, 2), (3, 4, 4)])
def test_route_kernel_matches_the_reference(N, E, K):
    """Distinct fp32 logits: the same experts in the same order, weights within fp32 rounding."""
    z, scale = _logits(N, E, torch.float32, seed=N + E)
    w, idx = route_topk(z, scale, K)
    w2, idx2 = route_triton(z, scale, K)
    assert idx2.dtype == torch.int64 and w2.dtype == torch.float32
    assert torch.equal(idx2, idx)
    torch.testing.assert_close(w2, w, rtol=4e-7 * 8, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_kernel_breaks_ties_by_the_lower_index(dtype):
    """Logits from a few values tie often (bf16 logits of 128 experts do): the kernel takes, among equal logits, the
    lower expert index first (torch.topk leaves that order to its implementation); its weights are the reference's
    arithmetic on those experts."""
    g = torch.Generator().manual_seed(1)
    z = torch.randint(-3, 3, (16, 128), generator=g).to(dtype).to(DEV) / 2
    scale = (torch.rand(128, generator=g) + 0.5).to(DEV)
    K = 8
    idx = torch.sort(z.float(), dim=-1, descending=True, stable=True).indices[:, :K]  # lower index first on ties
    p = torch.softmax(z.float(), dim=-1).gather(1, idx)
    w = p / p.sum(-1, keepdim=True) * scale[idx]
    w2, idx2 = route_triton(z, scale, K)
    assert torch.equal(idx2, idx)
    torch.testing.assert_close(w2, w, rtol=4e-7 * 8, atol=0)
    ones = torch.ones_like(scale)  # rank by rank, tied experts hold equal probabilities: the reference's weights
    torch.testing.assert_close(route_triton(z, ones, K)[0], route_topk(z, ones, K)[0], rtol=4e-7 * 8, atol=0)


def test_the_checked_kernel_and_the_op(monkeypatch):
    """The checked kernel compares the routing weight of every (token, expert) on its first call: a kernel that picks
    another expert is replaced by the reference, with a warning. The custom op (a compiled block's call) gives the
    kernel's result and passes opcheck."""
    z, scale = _logits(9, 16, torch.float32)
    monkeypatch.setattr(moe_grouped, "FIRST_USE", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w, idx = route_triton_checked(z, scale, 4)
    assert torch.equal(idx, route_topk(z, scale, 4)[1])
    assert all(torch.equal(a, b) for a, b in zip(route_triton_checked(z, scale, 4), route_triton(z, scale, 4)))

    monkeypatch.setattr(moe_grouped, "FIRST_USE", {})

    def wrong(z, scale, k):  # another expert in the last place
        w, idx = route_triton(z, scale, k)
        return w, torch.cat([idx[:, :-1], (idx[:, -1:] + 1) % z.shape[1]], 1)

    monkeypatch.setattr("blockpress.kernels.route.route_triton", wrong)
    with pytest.warns(RuntimeWarning, match="routing kernel is off"):
        w3, idx3 = route_triton_checked(z, scale, 4)
    assert torch.equal(idx3, route_topk(z, scale, 4)[1])

    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(route_op(z, scale, 4, "triton"), route_triton(z, scale, 4)))
    torch.library.opcheck(route_op, (z, scale, 4, "triton"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_triton
def test_minus_inf_logits_among_the_top_k_choose_distinct_experts():
    """A chosen expert was marked by setting its logit to -inf: once the best left was -inf, the kernel chose an
    expert it had chosen already ([4, 2, 0, 0] of five). The experts chosen are distinct, the -inf ones weigh 0."""
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), 2.0]], device=DEV)
    w, idx = route_triton(logits, torch.ones(5, device=DEV), 4)
    ref_w, ref_idx = route_topk(logits.cpu(), torch.ones(5), 4)
    assert len(set(idx[0].tolist())) == 4 and idx[0, :3].tolist() == ref_idx[0, :3].tolist() == [4, 2, 0]
    assert torch.allclose(w.cpu(), ref_w, atol=1e-6) and w[0, 3] == 0
