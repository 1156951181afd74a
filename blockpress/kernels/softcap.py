"""The final-logit soft cap in one pass over the logits (the reference makes four).

Shape legend: B batch, C canvas, V vocab.

`model.layers.softcap_logits` (the reference) turns the LM head's bf16 product [B, C, V] into fp32
`cap * tanh(x / cap)` with four whole-tensor passes: the cast, then the divide, tanh and multiply in place.
On the 26B model that is 134 MB read + 268 MB written by the cast and 3 x (268 + 268) MB by the rest,
~2 GB of traffic per denoising step (0.6 ms on an H100, a tenth of an int4 step's floor), for what one
elementwise kernel does reading 134 MB and writing 268 MB. `softcap_triton` is that kernel: the same fp32
division and, compiled for CUDA, libdevice's tanhf (what torch's CUDA tanh calls), so its result should
match the reference to an ulp or two (the GPU test checks; not yet run). Triton's CPU interpreter has no
libdevice, so there the kernel computes tanh as 2 sigmoid(2z) - 1 (a few ulp off; the CPU test allows it).
`kernels.select` picks it for a model's `ops.softcap` ("triton_checked" on a CUDA GPU, checked against the
reference on its first call per device and dtype).
"""

from __future__ import annotations

import torch

from ..model.layers import softcap_logits
from ._triton import interpreted, tl, triton
from .moe_grouped import FIRST_USE, checked_on_first_use

BLOCK = 4096

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _softcap_kernel(x_ptr, out_ptr, n, s_out, cap, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Row program_id(0) of x [R, n] (contiguous) into out's row at stride s_out, BLOCK columns a program."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        z = tl.math.div_rn(tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32), cap)
        if LIBDEVICE:
            t = libdevice.tanh(z)
        else:
            t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
        tl.store(out_ptr + row * s_out + offs, t * cap, mask=mask)


def _row_stride(t: torch.Tensor) -> int | None:
    """The stride between t's rows (its last dim) if its rows are evenly spaced with unit-stride columns (a
    contiguous tensor, or a slice of columns of one), else None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    if t.dim() == 1:
        return t.shape[0]
    s = t.stride(-2)
    for i in range(t.dim() - 2):
        if t.shape[i] > 1 and t.stride(i) != t.stride(i + 1) * t.shape[i + 1]:
            return None
    return s


def softcap_triton(logits: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 cap * tanh(logits / cap) of any-dtype logits, in one Triton kernel (into `out`, fp32 of their shape
    with evenly spaced rows, when given: a contiguous tensor, or a slice of the vocabulary's columns of one, as
    `lm_logits` writes a slice at a time)."""
    if triton is None:
        raise RuntimeError("softcap_triton needs triton (pip install triton)")
    x = logits.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    elif out.shape != x.shape or out.dtype != torch.float32 or _row_stride(out) is None:
        raise ValueError(f"out must be an fp32 tensor of shape {list(x.shape)} with evenly spaced rows")
    n = x.shape[-1] if x.dim() else 1
    rows = x.numel() // max(n, 1)
    if x.numel():
        _softcap_kernel[(rows, triton.cdiv(n, BLOCK))](x, out, n, _row_stride(out) if x.dim() else 1, float(cap),
                                                       BLOCK=BLOCK, LIBDEVICE=not interpreted())
    return out


def softcap_triton_checked(logits: torch.Tensor, cap: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`softcap_triton`, checked against the reference on its first call per device and dtype. With `out`, a
    later call's result is written there; a fallback's (the reference's) too."""
    key = (str(logits.device), str(logits.dtype).removeprefix("torch."), "triton soft cap", ())
    # the reference works in place on fp32 input (an fp32 model's logits): give it a copy, the kernel runs after it
    ref = lambda: softcap_logits(logits.clone() if logits.dtype == torch.float32 else logits, cap)  # noqa: E731
    checking = FIRST_USE.get(key) is None  # the first call compares two results: the kernel's must be its own
    res = checked_on_first_use(key, lambda: softcap_triton(logits, cap, out=None if checking else out), ref,
                               "the Triton soft-cap kernel")
    return res if out is None or res.data_ptr() == out.data_ptr() else out.copy_(res)

