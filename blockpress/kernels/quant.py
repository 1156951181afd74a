"""Low-precision expert weights: fp8 (per-output-channel scales) and packed int4 (group scales).

Shape legend: E experts, O output rows, I input columns of one weight [E, O, I] (gate_up: O = 2*Im,
I = H; down: O = H, I = Im), G group size along I, N tokens, K top-k.

Formats (the dequantised weight is always rounded to the activation dtype before the matmul):
- fp8:  q float8_e4m3fn [E, O, I], scale fp32 [E, O];  w = q * scale[..., None]
        (amax per output row / 448, so every row uses the full e4m3 range).
- int4: q uint8 [E, O, I/2] two nibbles per byte (column 2j in the low nibble, 2j+1 in the high),
        stored as q + 8 for q in [-8, 7]; scale [E, O, I/G] in the activation dtype;
        w = (nibble - 8) * scale[..., j // G]. Symmetric, scale = clip * amax / 7 per group with
        the clip ratio in CLIP_RATIOS that minimises the group's squared error (round-to-nearest
        with clipping search, ~12% less error than plain absmax on Gaussian weights); the scale is
        rounded to its storage dtype *before* the division so dequant is consistent.
G is `gcd(I, group_size)`: 64 divides both 2816 and 704 in the released model (4.25 bits/weight).

Only the experts (~90% of the bytes) are quantised; embeddings, attention, dense MLP, router and
self-conditioning stay in the model dtype. `quantize_experts_` swaps `layer.experts` for a
`QuantizedExperts` module, one layer at a time, so peak memory never holds two copies of a model.

QuantizedExperts backends: "torch" (reference: dequantise each busy expert, same math as
`experts_loop`), "triton" (fused dequant-in-registers kernel, moe_grouped.py), "scaled_mm"
(fp8 on Hopper: activations quantised per row, `torch._scaled_grouped_mm`; w8a8, so a slightly
different function, covered by the quality guard not the agreement test; host syncs, so no CUDA graph), "w8a8"
(fp8 weights and fp8 activations in the Triton kernels: each token and each expert activation quantised to fp8
with a scale per row, fp8 x fp8 dots, so no weight is converted on the way to the tensor cores, as vLLM runs fp8
MoE checkpoints; graph-safe; checked on first use against its own torch reference `experts_w8a8_torch`, which
also runs it on a CPU; its quality against weight-only fp8 is the quality guard's "fp8-a8"). "auto" picks triton
on CUDA, checked against torch on its first call (`moe_grouped.checked_on_first_use`: a kernel that
fails or disagrees on an untried GPU is replaced by torch with a warning), else torch. The forward is
`experts_quantized`, a function of the weights and settings; a compiled block calls it as the custom op
`quantized_experts_op` (one graph node, kernels/library.py says why).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from ..errors import InputError
from ..model.layers import gelu_tanh
from ._triton import fp8_usable_on
from .moe_grouped import (DEFAULT_TILES, FMT_FP8, FMT_INT4, as_tiles, checked_on_first_use, combine,
                          compiled_variant, experts_triton, route_by_expert, triton_supported)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FORMATS = ("fp8", "int4")
W8A8_FORMAT = "fp8-a8"  # the benchmarks' name for fp8 experts run with fp8 activations (experts="w8a8")
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)  # int4 clipping candidates (amax * ratio maps to 7)


# ------------------------------------------------------------------------------------ fp8

def quantize_fp8(w_EOI: torch.Tensor):
    """-> q float8_e4m3fn [E,O,I], scale fp32 [E,O] (per output channel)."""
    wf = w_EOI.float()
    scale = (wf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    q = (wf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def traced_fp8_rows(x: torch.Tensor) -> bool:
    """Can a compiled graph quantise rows of x to fp8 itself (`quantize_rows_fp8` traced, fused by the compiler into
    the kernel that made x)? On a CPU, and on a GPU with fp8 tensor cores: the compiler's Triton code cannot cast to
    e4m3 before sm_89 (there the w8a8 ops quantise inside, as uncompiled)."""
    return not x.is_cuda or fp8_usable_on(x.device)


def quantize_rows_fp8(x_MI: torch.Tensor):
    """Activations -> fp8 [M, I] and their fp32 scale per row [M] (amax / 448): what fp8 x fp8 matmuls (w8a8) take;
    the Triton experts' `_quant_rows_kernel` computes the same bytes."""
    xf = x_MI.float()
    scale = (xf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(q_EOI: torch.Tensor, scale_EO: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q_EOI.float() * scale_EO[..., None]).to(dtype)


# ------------------------------------------------------------------------------------ int4

def check_group_size(group_size) -> int:
    """The int4 scale group asked for: a power of two >= 16 (below 16 the bf16 scales cost over a quarter of the
    weights' bytes). The Triton kernel needs groups of >= 32 (moe_grouped.INT4_MIN_K); 16 runs the torch path. An
    odd request like 7 would otherwise become gcd(I, 7) = 1: a scale per weight, silently."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16 \
            or group_size & (group_size - 1):
        raise InputError(f"int4 group size must be a power of two >= 16 (a scale per 16, 32, 64 or 128 weights; "
                         f"default 64), got {group_size!r}")
    return group_size


def check_int4_sizes(text, precision: str, linears: str) -> None:
    """InputError (before any weight is read) unless every input size that int4 packs two to a byte is even: the
    experts' (hidden_size, moe_intermediate_size) with precision="int4", the dense MLP's (hidden_size,
    intermediate_size) with linears="int4-mlp". `text`: the model's TextConfig."""
    asked, sizes, instead = [], {}, []
    if precision == "int4":
        asked.append("precision='int4'")
        instead.append("precision='fp8'")
        sizes.update(hidden_size=text.hidden_size, moe_intermediate_size=text.moe_intermediate_size)
    if linears == "int4-mlp":
        asked.append("linears='int4-mlp'")
        instead.append("linears='int8' or 'fp8'")
        sizes.update(hidden_size=text.hidden_size, intermediate_size=text.intermediate_size)
    odd = [f"{k} {v}" for k, v in sizes.items() if v % 2]
    if odd:
        raise InputError(f"{' and '.join(asked)}: int4 packs two weights a byte along each weight's inputs, but "
                         f"this model's {', '.join(odd)} {'is' if len(odd) == 1 else 'are'} odd; use "
                         f"{' and '.join(instead)} (8 bits, a scale per output row) instead")


def group_for(in_features: int, group_size: int) -> int:
    """The group a weight with `in_features` inputs uses: the largest power of two dividing both (64 for the
    released model's 2816 and 704 at the default)."""
    return math.gcd(in_features, check_group_size(group_size))


def pack_int4(q_EOI: torch.Tensor) -> torch.Tensor:
    """Signed values in [-8, 7] [..., I] -> uint8 [..., I/2] (even column in the low nibble)."""
    u = (q_EOI + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., I/2] -> int8 [..., I] in [-8, 7]."""
    lo = (p & 0xF).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize_int4(w_EOI: torch.Tensor, group_size: int = 64, scale_dtype: torch.dtype | None = None):
    """-> packed uint8 [E,O,I/2], scale [E,O,I/G] (scale_dtype, default w's dtype)."""
    *lead, I = w_EOI.shape
    if I % 2:
        raise ValueError(f"int4 packing needs an even input size, got {I}")
    G = group_for(I, group_size)
    wf = w_EOI.float().reshape(*lead, I // G, G)  # [E, O, I/G, G]
    amax = wf.abs().amax(-1)
    best_err = scale = None
    for clip in CLIP_RATIOS:  # per group, keep the clipping that minimises the squared error
        s = (amax * (clip / 7.0)).clamp_min(1e-8).to(scale_dtype or w_EOI.dtype)
        sf = s.float()[..., None]
        err = ((torch.round(wf / sf).clamp(-8, 7) * sf - wf) ** 2).sum(-1)
        if best_err is None:
            best_err, scale = err, s
        else:
            better = err < best_err
            best_err, scale = torch.where(better, err, best_err), torch.where(better, s, scale)
    q = torch.round(wf / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).reshape(*lead, I)
    return pack_int4(q), scale


def dequantize_int4(p_EOI2: torch.Tensor, scale_EOg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = unpack_int4(p_EOI2).float()  # [E, O, I]
    G = q.shape[-1] // scale_EOg.shape[-1]
    w = q.unflatten(-1, (scale_EOg.shape[-1], G)) * scale_EOg.float()[..., None]
    return w.flatten(-2).to(dtype)


# ------------------------------------------------------------------------------------ module

class QuantizedExperts(nn.Module):
    """Drop-in for `model.moe.Experts` (same forward signature) holding fp8 or int4 weights."""

    def __init__(self, n_experts: int, hidden: int, inter: int, fmt: str, group_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown expert weight format {fmt!r}; use one of {FORMATS}")
        self.fmt, self.dtype, self.inter, self.hidden = fmt, dtype, inter, hidden
        # the kernel: "auto" (Triton where it runs, checked on first use), "triton" (unchecked), "scaled_mm", "torch",
        # "w8a8" (fp8 activations too: the Triton kernel on CUDA, checked on first use, else its torch reference),
        # "triton-a8" (that kernel, unchecked);
        # with the Triton kernel's tiles and K sum. Chosen by kernels.select.
        self.backend, self.tiles, self.moe_sum = "auto", DEFAULT_TILES, "kernel"
        E, H, Im = n_experts, hidden, inter
        kw = dict(device=device)
        if fmt == "fp8":
            self.groups = (H, Im)
            self.register_buffer("gate_up_q", torch.empty(E, 2 * Im, H, dtype=FP8, **kw))
            self.register_buffer("gate_up_scale", torch.empty(E, 2 * Im, dtype=torch.float32, **kw))
            self.register_buffer("down_q", torch.empty(E, H, Im, dtype=FP8, **kw))
            self.register_buffer("down_scale", torch.empty(E, H, dtype=torch.float32, **kw))
        else:
            g_up, g_dn = group_for(H, group_size), group_for(Im, group_size)
            self.groups = (g_up, g_dn)
            self.register_buffer("gate_up_q", torch.empty(E, 2 * Im, H // 2, dtype=torch.uint8, **kw))
            self.register_buffer("gate_up_scale", torch.empty(E, 2 * Im, H // g_up, dtype=dtype, **kw))
            self.register_buffer("down_q", torch.empty(E, H, Im // 2, dtype=torch.uint8, **kw))
            self.register_buffer("down_scale", torch.empty(E, H, Im // g_dn, dtype=dtype, **kw))
        self.group_size = group_size

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, groups={self.groups}, dtype={self.dtype}, backend={self.backend}"

    # -------------------------------------------------------------------------- (de)quantise
    @torch.no_grad()
    def load_float_(self, gate_up_EFH: torch.Tensor, down_EHI: torch.Tensor, chunk: int = 16) -> "QuantizedExperts":
        """Quantise float weights into this module, `chunk` experts at a time (bounded temporaries)."""
        for name, w in (("gate_up", gate_up_EFH), ("down", down_EHI)):
            q_all, s_all = getattr(self, f"{name}_q"), getattr(self, f"{name}_scale")
            for e0 in range(0, w.shape[0], chunk):
                part = w[e0:e0 + chunk].to(q_all.device)
                q, s = quantize_fp8(part) if self.fmt == "fp8" else quantize_int4(part, self.group_size, self.dtype)
                q_all[e0:e0 + chunk] = q
                s_all[e0:e0 + chunk] = s
        return self

    def dequantize(self, which: str, experts: slice | int = slice(None)) -> torch.Tensor:
        """Float weight `which` in {"gate_up", "down"} (rows `experts`) in the activation dtype."""
        q, s = getattr(self, f"{which}_q")[experts], getattr(self, f"{which}_scale")[experts]
        return dequantize_weight(q, s, self.fmt, self.dtype)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    # -------------------------------------------------------------------------- forward
    def resolved_backend(self, x: torch.Tensor) -> str:
        return quantized_backend(self.backend, self.fmt, self.groups, x)

    def _weights(self) -> tuple:
        return self.gate_up_q, self.gate_up_scale, self.down_q, self.down_scale

    def forward(self, x_NH, w_NK, idx_NK):
        if torch.is_grad_enabled() and (x_NH.requires_grad or w_NK.requires_grad):
            # training through frozen quantised experts (QLoRA): the fused kernels have no backward; the torch
            # path is differentiable in its input and keeps no dequantised weight for the backward pass
            return self._forward_torch(x_NH, w_NK, idx_NK)
        if torch.compiler.is_compiling():  # a compiled block: one call of the custom op (the same function)
            xs = None
            if self.resolved_backend(x_NH) in ("triton-a8", "torch-a8") and traced_fp8_rows(x_NH):
                # w8a8: the tokens quantised in traced torch, which the compiler fuses into the norm before
                x_NH, xs = quantize_rows_fp8(x_NH)
            return quantized_experts_op(x_NH, w_NK, idx_NK, *self._weights(), self.fmt, self.dtype, list(self.groups),
                                        self.backend, self.tiles.spec(), self.moe_sum, xs)
        return experts_quantized(x_NH, w_NK, idx_NK, *self._weights(), self.fmt, self.dtype, self.groups,
                                 self.backend, self.tiles, self.moe_sum)

    def _forward_torch(self, x_NH, w_NK, idx_NK):
        """Reference: like experts_loop, dequantising each busy expert once."""
        return experts_quantized_torch(x_NH, w_NK, idx_NK, *self._weights(), self.fmt, self.dtype)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """A quantised weight (fp8 or packed int4, any leading dims) in `dtype`."""
    return dequantize_fp8(q, scale, dtype) if fmt == "fp8" else dequantize_int4(q, scale, dtype)


def run_format(weights: str, experts: str) -> str:
    """The format a kernel runs for weights in `weights` under the `experts` option: fp8 weights with fp8
    activations (experts="w8a8") are W8A8_FORMAT; every other pairing, the weights' own (`expert_format`'s
    inverse)."""
    return W8A8_FORMAT if experts == "w8a8" and weights == "fp8" else weights


def expert_format(name: str) -> tuple[str, bool]:
    """A benchmark's expert format ("native", "fp8", "int4" or W8A8_FORMAT) -> (the weights' format, whether the
    activations are fp8 too)."""
    return ("fp8", True) if name == W8A8_FORMAT else (name, False)


def check_experts_precision(experts: str, precision: str, linears: str = "native") -> None:
    """ValueError naming the fix where an experts backend needs weights the model will not hold: "scaled_mm"
    (torch's grouped fp8 GEMM) needs fp8 experts; "w8a8" (fp8 activations wherever the weights are fp8) needs fp8
    experts or fp8 projections (`linears`). Cheap: `load` asks it before reading a weight, `configure` after."""
    if experts == "scaled_mm" and precision != "fp8":
        raise ValueError("the scaled_mm experts backend (torch's grouped fp8 GEMM) needs fp8 experts; add --precision "
                         "fp8 (or load an fp8 checkpoint)")
    if experts == "w8a8" and precision != "fp8" and linears != "fp8":
        raise ValueError("fp8 activations (the w8a8 backend) need fp8 weights; add --precision fp8 and / or --linears "
                         "fp8 (or load an fp8 checkpoint)")


def quantized_backend(backend: str, fmt: str, groups: tuple, x: torch.Tensor) -> str:
    """What a `QuantizedExperts.backend` runs on x's device: "triton", "scaled_mm" or "torch"; for "w8a8" (fp8
    weights and activations) "triton-a8" (the kernel, on CUDA) or "torch-a8" (its reference), and "triton-a8" asked
    by name is the kernel anywhere (Triton's interpreter on a CPU)."""
    code = FMT_FP8 if fmt == "fp8" else FMT_INT4
    if backend in ("w8a8", "triton-a8"):
        if fmt != "fp8":
            raise ValueError(f"the {backend} experts backend (fp8 activations) needs fp8 experts, not {fmt}")
        runs = (backend == "triton-a8" or x.is_cuda) and triton_supported(x, code, groups)
        return "triton-a8" if runs else "torch-a8"
    # "auto" takes Triton on CUDA only (on a CPU it would be the interpreter); "triton" forces it
    if (backend == "triton" or (backend == "auto" and x.is_cuda)) and triton_supported(x, code, groups):
        return "triton"
    if backend == "scaled_mm":
        return backend
    return "torch"


def _inter(down_q: torch.Tensor, fmt: str) -> int:
    return down_q.shape[-1] * (1 if fmt == "fp8" else 2)  # int4 packs two columns a byte


def experts_quantized(x_NH, w_NK, idx_NK, gate_up_q, gate_up_scale, down_q, down_scale, fmt: str,
                      dtype: torch.dtype, groups: tuple, backend: str, tiles, moe_sum: str,
                      x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`QuantizedExperts.forward` without autograd, as a function of its weights and settings (what its custom op
    runs): the backend `quantized_backend` resolves; "auto" on CUDA is the Triton kernel checked against the torch
    path on its first call per device, dtype and compiled variant. x_scale (the w8a8 backends only): x_NH is fp8
    tokens quantised already, these their scales (a compiled block's path, `QuantizedExperts.forward`)."""
    which = quantized_backend(backend, fmt, groups, x_NH)
    if x_scale is not None and which not in ("triton-a8", "torch-a8"):
        raise ValueError(f"tokens quantised to fp8 need the w8a8 experts backend, not {which}")
    weights = (gate_up_q, gate_up_scale, down_q, down_scale)
    if which == "triton":
        def fast():
            return experts_triton(x_NH, w_NK, idx_NK, gate_up_q, down_q, fmt=FMT_FP8 if fmt == "fp8" else FMT_INT4,
                                  gate_up_scale=gate_up_scale, down_scale=down_scale, groups=tuple(groups),
                                  inter=_inter(down_q, fmt), tiles=tiles, moe_sum=moe_sum)

        if backend == "triton":  # asked for by name: the kernel, unchecked
            return fast()
        key = (str(x_NH.device), str(x_NH.dtype).removeprefix("torch."), f"triton {fmt} experts",
               compiled_variant(idx_NK, gate_up_q.shape[0], tiles, moe_sum))
        return checked_on_first_use(key, fast, lambda: experts_quantized_torch(x_NH, w_NK, idx_NK, *weights, fmt, dtype),
                                    f"the Triton {fmt} experts kernel")
    if which == "triton-a8":
        def fast_a8():
            return experts_triton(x_NH, w_NK, idx_NK, gate_up_q, down_q, fmt=FMT_FP8, gate_up_scale=gate_up_scale,
                                  down_scale=down_scale, groups=tuple(groups), inter=_inter(down_q, fmt), tiles=tiles,
                                  moe_sum=moe_sum, act8=True, x_scale=x_scale, out_dtype=dtype)

        if backend == "triton-a8":  # asked for by name: the kernel, unchecked
            return fast_a8()
        key = (str(x_NH.device), str(dtype).removeprefix("torch."),
               "triton w8a8 experts" + (", tokens quantised" if x_scale is not None else ""),
               compiled_variant(idx_NK, gate_up_q.shape[0], tiles, moe_sum))
        return checked_on_first_use(key, fast_a8, lambda: experts_w8a8_torch(x_NH, w_NK, idx_NK, *weights, x_scale,
                                                                             dtype),
                                    "the Triton w8a8 experts kernel")
    if which == "torch-a8":
        return experts_w8a8_torch(x_NH, w_NK, idx_NK, *weights, x_scale, dtype)
    if which == "scaled_mm":
        return experts_quantized_scaled_mm(x_NH, w_NK, idx_NK, *weights, fmt)
    return experts_quantized_torch(x_NH, w_NK, idx_NK, *weights, fmt, dtype)


@torch.library.custom_op("blockpress::quantized_experts", mutates_args=())
def quantized_experts_op(x_NH: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_q: torch.Tensor,
                         gate_up_scale: torch.Tensor, down_q: torch.Tensor, down_scale: torch.Tensor, fmt: str,
                         dtype: torch.dtype, groups: list[int], backend: str, tiles: str,
                         moe_sum: str, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`experts_quantized` as one opaque call in a compiled graph (tiles: a spec string); kernels/library.py says
    why."""
    return experts_quantized(x_NH, w_NK, idx_NK, gate_up_q, gate_up_scale, down_q, down_scale, fmt, dtype,
                             tuple(groups), backend, as_tiles(tiles), moe_sum, x_scale)


@quantized_experts_op.register_fake
def _(x_NH, w_NK, idx_NK, gate_up_q, gate_up_scale, down_q, down_scale, fmt, dtype, groups, backend, tiles, moe_sum,
      x_scale=None):
    # the kernels return contiguous [N, H] in the tokens' dtype, or the model's for tokens quantised to fp8
    return x_NH.new_empty(x_NH.shape, dtype=dtype if x_scale is not None else x_NH.dtype)


def experts_quantized_torch(x_NH, w_NK, idx_NK, gate_up_q, gate_up_scale, down_q, down_scale, fmt: str,
                            dtype: torch.dtype) -> torch.Tensor:
    """Reference: like experts_loop, dequantising each busy expert once (differentiable in x)."""
    N, H = x_NH.shape
    K, Im = idx_NK.shape[1], _inter(down_q, fmt)
    order, counts, _ = route_by_expert(idx_NK, gate_up_q.shape[0])
    tok = order // K
    y = x_NH.new_empty(N * K, H)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        xs = x_NH[tok[start:start + c]]
        u = DequantMatmul.apply(xs, gate_up_q[e], gate_up_scale[e], fmt, dtype)  # [c, 2*Im] = xs @ W^T
        a = gelu_tanh(u[:, :Im]) * u[:, Im:]
        y[start:start + c] = DequantMatmul.apply(a, down_q[e], down_scale[e], fmt, dtype)
        start += c
    return combine(y, order, w_NK, x_NH.dtype)


def experts_w8a8_torch(x_NH, w_NK, idx_NK, gate_up_q, gate_up_scale, down_q, down_scale,
                       x_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference of the w8a8 experts (fp8 weights and fp8 activations, `experts="w8a8"`): each token quantised to
    fp8 with its own scale (`quantize_rows_fp8`), the fp8 x fp8 products summed in fp32 and scaled by the weight
    row's and the token's scales, gate and up kept in fp32 through the GELU, the activation rounded to the model
    dtype and quantised per row again for the down projection, whose output is rounded to the model dtype; the K
    outputs summed as `combine` does. The Triton kernels (`experts_triton(..., act8=True)`) compute this up to the
    order of the fp32 sums (and, on Hopper, the tensor cores' fp8 accumulation). x_scale: x_NH is fp8 tokens quantised
    already (`quantize_rows_fp8`'s), these their scales, and dtype the model dtype (a compiled block's path)."""
    N, H = x_NH.shape
    K, Im = idx_NK.shape[1], _inter(down_q, "fp8")
    order, counts, _ = route_by_expert(idx_NK, gate_up_q.shape[0])
    tok = order // K
    xq, sx = (x_NH, x_scale) if x_scale is not None else quantize_rows_fp8(x_NH)
    dtype = dtype or x_NH.dtype
    y = x_NH.new_empty(N * K, H, dtype=dtype)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        t = tok[start:start + c]
        u = (xq[t].float() @ gate_up_q[e].float().t()) * gate_up_scale[e][None, :] * sx[t][:, None]
        a = (gelu_tanh(u[:, :Im]) * u[:, Im:]).to(dtype)
        aq, sa = quantize_rows_fp8(a)
        y[start:start + c] = ((aq.float() @ down_q[e].float().t()) * down_scale[e][None, :] * sa[:, None]).to(y.dtype)
        start += c
    return combine(y, order, w_NK, dtype)


def experts_quantized_scaled_mm(x_NH, w_NK, idx_NK, gate_up_q, gate_up_scale, down_q, down_scale,
                                fmt: str) -> torch.Tensor:
    """Hopper fp8 x fp8 grouped GEMMs with per-row activation scales (w8a8)."""
    if fmt != "fp8":
        raise ValueError("the scaled_mm backend needs fp8 experts")
    K, Im = idx_NK.shape[1], _inter(down_q, fmt)
    order, _, offs = route_by_expert(idx_NK, gate_up_q.shape[0])
    xs = x_NH[order // K]
    u = _fp8_grouped(xs, gate_up_q, gate_up_scale, offs)
    a = gelu_tanh(u[:, :Im]) * u[:, Im:]
    y = _fp8_grouped(a, down_q, down_scale, offs)
    return combine(y, order, w_NK, x_NH.dtype)


class DequantMatmul(torch.autograd.Function):
    """x [c, I] @ W^T for one expert's quantised weight (q, scale: its rows of the module's buffers), differentiable
    in x only (the weight is frozen). Plain autograd would keep each dequantised weight alive until the backward pass
    (a float copy of every busy expert of the model at once); this dequantises it again in the backward instead, so
    at most one expert's float weight exists at a time."""

    @staticmethod
    def forward(ctx, x, q, scale, fmt: str, dtype: torch.dtype):
        ctx.q, ctx.scale, ctx.fmt, ctx.dtype = q, scale, fmt, dtype
        return x @ dequantize_weight(q, scale, fmt, dtype).to(x.dtype).t()

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return grad @ dequantize_weight(ctx.q, ctx.scale, ctx.fmt, ctx.dtype).to(grad.dtype), None, None, None, None


def _fp8_grouped(x_AI, q_EOI, scale_EO, offs):
    xq, sa = quantize_rows_fp8(x_AI)  # [A] per-row activation scale
    return torch._scaled_grouped_mm(xq, q_EOI.transpose(1, 2), sa, scale_EO, offs=offs,
                                    out_dtype=x_AI.dtype, use_fast_accum=True)


@torch.no_grad()
def _quantize_layer_(layer: nn.Module, fmt: str, group_size: int, backend: str = "auto") -> None:
    old = layer.experts
    E, two_im, H = old.gate_up_proj.shape
    q = QuantizedExperts(E, H, two_im // 2, fmt, group_size, dtype=old.gate_up_proj.dtype,
                         device=old.gate_up_proj.device)
    q.load_float_(old.gate_up_proj, old.down_proj)
    q.backend = backend
    layer.experts = q


def quantize_experts_(module: nn.Module, fmt: str, group_size: int = 64, backend: str = "auto") -> nn.Module:
    """Swap every `layer.experts` of a DiffusionGemmaModel for QuantizedExperts, in place, freeing
    each layer's float experts before the next one is quantised. Returns the module."""
    for layer in module.layers:
        _quantize_layer_(layer, fmt, group_size, backend)
    return module


_EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")


class QuantizedMLP(nn.Module):
    """A layer's dense MLP, down(gelu_tanh(gate x) * up x), in int4 through the expert kernels (linears="int4-mlp"):
    one expert that every token takes with weight 1, its gate and up rows stacked as the expert's gate_up, so the
    MLP runs on the int4 experts' Triton kernels (and their torch reference) with nothing written twice. The same
    function as the float MLP on the dequantised weights, up to where the expert path rounds (its gate and up
    products stay fp32 until the activation is stored). On the 26B model: 1.07 GB of bf16 MLP weights become 0.30 GB."""

    def __init__(self, hidden: int, inter: int, group_size: int = 64, dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        self.experts = QuantizedExperts(1, hidden, inter, "int4", group_size, dtype=dtype, device=device)
        self._routing: dict = {}  # (rows, device) -> (weights 1, expert 0): made once per shape, not per call

    @classmethod
    @torch.no_grad()
    def from_mlp(cls, mlp: nn.Module, group_size: int = 64) -> "QuantizedMLP":
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        q = cls(gate.shape[1], gate.shape[0], group_size, dtype=gate.dtype, device=gate.device)
        q.experts.load_float_(torch.cat([gate, up])[None], down[None])
        return q

    def _route(self, n: int, device: torch.device):
        """Every row to the one expert with weight 1 ([n, 1] each). Kept per shape outside a compiled graph (the
        kernels only read them), so a step replays no fill kernels for them; made in place while compiling."""
        if torch.compiler.is_compiling():
            return (torch.ones(n, 1, dtype=torch.float32, device=device),
                    torch.zeros(n, 1, dtype=torch.int64, device=device))
        key = (n, device)
        if key not in self._routing:
            if len(self._routing) >= 8:  # prompts of many lengths: keep a few shapes (the canvas's stay hot)
                self._routing.clear()
            self._routing[key] = (torch.ones(n, 1, dtype=torch.float32, device=device),
                                  torch.zeros(n, 1, dtype=torch.int64, device=device))
        return self._routing[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self.experts(flat, *self._route(flat.shape[0], x.device)).view(x.shape)


_MLP_WEIGHT = re.compile(r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def quantize_mlp_(module: nn.Module, group_size: int = 64) -> nn.Module:
    """Swap every layer's dense MLP for QuantizedMLP, in place, one layer at a time. Returns the module."""
    for layer in module.layers:
        if not isinstance(layer.mlp, QuantizedMLP):
            layer.mlp = QuantizedMLP.from_mlp(layer.mlp, group_size)
    return module


def when_layer_loaded(pattern: re.Pattern, parts: int, act):
    """A `load_weights(on_loaded=...)` hook: act(i) once all `parts` tensors of layer i that `pattern` names are
    loaded (the pattern's groups: the layer index, the part)."""
    seen: dict[int, set[str]] = {}

    def on_loaded(name: str) -> None:
        m = pattern.search(name)
        if m is None:
            return
        i = int(m.group(1))
        seen.setdefault(i, set()).add(m.group(2))
        if len(seen[i]) == parts:
            act(i)

    return on_loaded


def mlp_streaming_quantizer(module: nn.Module, group_size: int = 64):
    """A `load_weights(on_loaded=...)` hook: a layer's MLP is quantised once its three weights are in."""

    def quantize(i: int) -> None:
        module.layers[i].mlp = QuantizedMLP.from_mlp(module.layers[i].mlp, group_size)

    return when_layer_loaded(_MLP_WEIGHT, 3, quantize)


def streaming_quantizer(module: nn.Module, fmt: str, group_size: int = 64):
    """A `load_weights(on_loaded=...)` hook: as soon as both float expert tensors of a layer are loaded,
    that layer's experts are quantised and the float copies dropped. The float experts of the whole
    model never exist at once (peak: the quantised model + about one layer in float), so a checkpoint
    too big for the device in bf16 loads straight into fp8 / int4."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert weight format {fmt!r}; use one of {FORMATS}")
    return when_layer_loaded(_EXPERT_TENSOR, 2, lambda i: _quantize_layer_(module.layers[i], fmt, group_size))


def experts_weight_bytes(module: nn.Module) -> int:
    total = 0
    for layer in module.layers:
        ex = layer.experts
        total += ex.weight_bytes() if isinstance(ex, QuantizedExperts) else sum(
            p.numel() * p.element_size() for p in ex.parameters())
    return total


def compare_logits(ref_BCV: torch.Tensor, test_BCV: torch.Tensor) -> dict:
    """Quality of a low-precision pass vs the reference: mean KL(p_ref || p_test) per position (nats),
    top-1 agreement, and max |p_ref - p_test|."""
    lp_ref = torch.log_softmax(ref_BCV.float(), -1)
    lp_test = torch.log_softmax(test_BCV.float(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp_test)).sum(-1)
    top1 = (ref_BCV.argmax(-1) == test_BCV.argmax(-1)).float().mean()
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1_agreement": float(top1),
            "max_prob_diff": float((lp_ref.exp() - lp_test.exp()).abs().max())}
