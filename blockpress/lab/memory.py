"""Peak memory accounting on the meta device: how much a pass allocates at once, without a GPU.

`LiveBytes` is a dispatch mode that records every tensor an op allocates inside it and frees it when
the last Python reference to it (or to a view of it) goes, so `peak` is the most bytes alive at once:
what `torch.cuda.max_memory_allocated()` adds on top of what existed before (weights, cache), less the
caching allocator's rounding and fragmentation. In-place ops and views allocate nothing.

On the meta device the kernels that a GPU runs fused are replaced by stand-ins that allocate what the
GPU path allocates (`meta_backends`): the Triton experts (the padded assignment list, the [L, Im]
activations, the [A, H] per-assignment outputs and their weighted sum [N, H]) and the SDPA kernel inside
`attention_sdpa_gqa` (its output in CUDA's layout, the padded mask copy and fp32 accumulator of the
memory-efficient kernel; flash / memory-efficient SDPA keep no score matrix; the GPU test
`test_sdpa_gqa_runs_a_fused_kernel_on_the_26b_shapes` checks that no pass needs the math kernel). Everything
else is the engine's own code, the attention's folded queries and repeated masks included.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """with LiveBytes() as lb: ...  ->  lb.peak (bytes alive at once), lb.live (still alive), lb.largest."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.largest: list[tuple[int, str]] = []  # (bytes, op) of each allocation

    def _release(self, rec: list) -> None:
        rec[0] -= 1
        if rec[0] == 0:
            self.live -= rec[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:  # in place / out=: no new storage
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if func.is_view or _shares_storage(t, args):  # a view (or `_unsafe_view`): keeps its base's record alive
                base = next((a for a in args if isinstance(a, torch.Tensor) and hasattr(a, "_bp_live")
                             and a.untyped_storage()._cdata == t.untyped_storage()._cdata), None)
                if base is not None:
                    rec = base._bp_live
                    rec[0] += 1
                    t._bp_live = rec
                    weakref.finalize(t, self._release, rec)
                continue
            rec = [1, t.numel() * t.element_size()]
            t._bp_live = rec
            self.live += rec[1]
            self.peak = max(self.peak, self.live)
            self.largest.append((rec[1], func.__name__))
            weakref.finalize(t, self._release, rec)
        return out

    def top(self, n: int = 6) -> list[tuple[int, str]]:
        return sorted(self.largest, reverse=True)[:n]


def _shares_storage(t: torch.Tensor, args) -> bool:
    """Whether `t` lives in an argument's storage: ops that are views without saying so in their schema, such as
    `_unsafe_view` (a matmul's reshape of its product), allocate nothing."""
    mine = t.untyped_storage()._cdata
    return any(isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == mine for a in args)


def _experts_meta(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI, block_m: int | None = None, tiles=None,
                  moe_sum: str = "kernel"):
    """The Triton experts path's allocations (moe_grouped.experts_triton), shapes only; block_m None: the tiles',
    else `bm=auto` as on sm_90 (its M tiles are the widest, so its padded assignment list the longest)."""
    from ..kernels import moe_grouped

    N, H = x_NH.shape
    K, E, Im = idx_NK.shape[1], gate_up_EFH.shape[0], down_EHI.shape[-1]
    tiles = tiles or moe_grouped.DEFAULT_TILES
    block_m = block_m or tiles.block_m or moe_grouped.auto_block_m(N, K, E, wgmma=True, swap=tiles.swap)
    A = N * K
    L = -(-(A + E * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.empty(L, dtype=torch.long, device=x_NH.device)  # noqa: F841 - alive like the kernel's
    act = x_NH.new_empty(L, Im)  # noqa: F841
    if moe_sum == "atomic":  # the weighted sum added into fp32 by the down kernel, then cast
        acc = x_NH.new_empty(N, H, dtype=torch.float32)  # noqa: F841
    else:
        y = x_NH.new_empty(A, H)  # noqa: F841 - per-assignment outputs, alive until the weighted sum is written
    return x_NH.new_empty(N, H)


MASK_ALIGN = 16  # bytes: the memory-efficient kernel's mask rows are padded to this (PyTorch's `pad_bias`)


def _fused_sdpa_meta(q, k, v, attn_mask=None, scale=None, enable_gqa=False):
    """What a fused CUDA SDPA kernel allocates (flash and memory-efficient keep no score matrix): its output, laid
    out as CUDA lays it, [B, S, heads, Dv] returned as the transposed view [B, heads, S, Dv]; with a mask (the
    memory-efficient kernel) a copy of the mask padded to 16-byte rows where its rows are not (`pad_bias`); and for
    16-bit outputs with head dims over 128, the kernel's fp32 output accumulator."""
    B, H, S, _ = q.shape
    Dv = v.shape[-1]
    if attn_mask is not None:
        row = attn_mask.shape[-1] * attn_mask.element_size()
        if row % MASK_ALIGN:
            padded = attn_mask.new_empty(*attn_mask.shape[:-1], -(-row // MASK_ALIGN) * MASK_ALIGN  # noqa: F841
                                         // attn_mask.element_size())
    if q.element_size() < 4 and Dv > 128:
        accumulator = q.new_empty(B, S, H, Dv, dtype=torch.float32)  # noqa: F841 - alive while the kernel runs
    return q.new_empty(B, S, H, Dv).transpose(1, 2)


class _FusedSdpaTraining(torch.autograd.Function):
    """A fused CUDA SDPA kernel under autograd (training): the forward allocates as `_fused_sdpa_meta` and keeps
    what the flash / memory-efficient kernels keep for their backward (q, k, v, the mask, the output and its fp32
    log-sum-exp rows [B, heads, S]; no score matrix); the backward allocates dq, dk, dv and the kernel's fp32
    row sums (`delta`, [B, heads, S])."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale):
        out = _fused_sdpa_meta(q, k, v, attn_mask=attn_mask, scale=scale)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, attn_mask, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _mask, _out, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)  # noqa: F841 - alive while the backward kernel runs
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None


def _fused_sdpa_training(q, k, v, attn_mask=None, scale=None, enable_gqa=False):
    return _FusedSdpaTraining.apply(q, k, v, attn_mask, scale)  # with enable_gqa the kernel reads k, v as they are


def attention_meta_training(q, k, v, mask):
    """The GPU's attention under autograd on the meta device (`attention_sdpa_gqa` around `_FusedSdpaTraining`):
    what a training step keeps for the attention's backward, as the fused kernels keep it."""
    from ..kernels.attention import attention_sdpa_gqa

    return attention_sdpa_gqa(q, k, v, mask, sdpa=_fused_sdpa_training)


def _attention_meta(q, k, v, mask):
    """The GPU's attention (`attention_sdpa_gqa`: folded queries, a mask repeated per group, or a call per group)
    around a fused kernel's allocation."""
    from ..kernels.attention import attention_sdpa_gqa

    return attention_sdpa_gqa(q, k, v, mask, sdpa=_fused_sdpa_meta)


def meta_backends(module, moe_sum: str = "kernel") -> None:
    """Run `module` (on the meta device, float experts) through the stand-ins above (its `ops` and experts' kernel,
    what kernels.select sets on a GPU)."""
    import dataclasses
    import functools

    for layer in module.layers:
        layer.experts.kernel = functools.partial(_experts_meta, moe_sum=moe_sum)
    module.ops = dataclasses.replace(module.ops, attention=_attention_meta)


def fused_sample_meta(raw, tau=None, generator=None, out_dtype=None, backend: str = "auto", out=None, cap=None,
                      bias=None):
    """The Triton fused sampler's allocations (sampler_fused.fused_sample_triton): y, a, h and z (none with `out`;
    the soft cap, `cap`, and the bias are applied in registers)."""
    B, C, V = raw.shape
    dev = raw.device
    y = torch.empty(B, C, dtype=torch.int64, device=dev)
    a = torch.empty(B, C, dtype=torch.int64, device=dev)
    h = torch.empty(B, C, dtype=torch.float32, device=dev)
    return y, a, h, torch.empty(B, C, V, dtype=out_dtype or torch.float32, device=dev) if out is None else out

