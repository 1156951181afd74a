"""8-bit linears: the attention projections and the dense MLP in half the bytes (int8 or fp8 weights).

Shape legend: M rows of activations (tokens), I input features, O output features, BM/BN/BK tiles.

Why: at batch 1 a denoising step of the 26B-A4B model reads every weight once. With the experts in
fp8 / int4 (quant.py), the attention projections and the dense MLP stay the largest bf16 part: 3.29 GB
per step (17 % of an int4 step, 11 % of an fp8 one) and 3.29 GB of GPU memory. In 8 bits they are half
that: an int4 step moves 19.21 -> 17.56 GB and the int4 model shrinks by 1.65 GB. The router,
embeddings, norms and self-conditioning stay in the model dtype (small, and quality-sensitive).

Formats (a scale per output row, fp32): "int8": q int8 [O, I], scale = amax / 127, round to nearest;
"fp8": q float8_e4m3fn [O, I], scale = amax / 448 (quant.quantize_fp8). w = q * scale[:, None]. int8 keeps
~7 bits for a row's bulk against fp8's 3 (a third of the error, `quality_guard.py`); fp8 is what Hopper's
fp8 tensor cores take, so only fp8 weights can also run with 8-bit activations.

Backends of `QuantizedLinear` (chosen by `kernels.configure(..., linears=)`):
- "torch" (reference): `F.linear(x, w)` with w dequantised into the activation dtype on each call;
- "triton": weight-only, one kernel: 8-bit tiles converted in registers, the row scale applied to the
  fp32 accumulator (it factors out of the dot product), no dequantised copy in memory;
- "scaled_mm" (fp8 only): w8a8, activations quantised to fp8 per row, `torch._scaled_mm` with row and
  column scales: half the math of the others on Hopper / Ada (at 256 rows a projection is compute-bound
  in 8 bits), a different function (activation rounding), judged by the quality guard, not the agreement
  test (which checks it against the same w8a8 arithmetic in fp32); on an H200 it ran 5.6x slower than
  cuBLAS bf16 at these shapes (benchmarks/results/2026-11-25-h200.md);
- "w8a8" (fp8 only; int8 runs "auto"): the same w8a8 function in our own kernels, `experts="w8a8"`'s choice
  for the projections: each row quantised to fp8 by one launch (the experts' `_quant_rows_kernel`), then the
  Triton kernel below with fp8 x fp8 dots, both scales on the fp32 accumulator, no weight converted; checked on
  first use against `linear_fp8_w8a8_reference` on a CUDA GPU, that reference elsewhere ("triton-a8": the
  kernel unchecked, also in Triton's interpreter);
- "auto": triton on CUDA, checked against torch on its first call per device, dtype and compiled
  variant (`moe_grouped.checked_on_first_use`), else torch.
The kernels are free of host synchronisation, so CUDA graphs hold them. The forward is `linear_q`, a function of
the weight and settings; a compiled block calls it as the custom op `linear_q_op` (one graph node, the first-use
check inside it; kernels/library.py says why), except with fp8 activations: there the rows are quantised in traced
torch (`quantize_rows_fp8`), which the compiler folds into the kernel that made them (the norm before q/k/v and
gate/up, the activation before down: no launch of its own), and `linear_a8_op` takes the quantised rows.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..options import LINEAR_FORMATS
from ._triton import fp8_usable_on, interpreted, tl, triton, usable_on
from .moe_grouped import _stages, checked_on_first_use, fp8_rows, runs_wgmma
if triton is not None:
    from .moe_grouped import _cols, _dot, _dot8, _rows
from .quant import FP8, dequantize_fp8, quantize_fp8, quantize_rows_fp8, traced_fp8_rows

INT8_MAX = 127.0
# the projections made 8-bit, by the module that holds them (router, embeddings, self-conditioning stay)
QUANTIZED_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                     "mlp": ("gate_proj", "up_proj", "down_proj")}
LINEAR_WEIGHT = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")


def quantize_int8_rows(w_OI: torch.Tensor):
    """-> q int8 [O, I], scale fp32 [O] (per output row)."""
    wf = w_OI.float()
    scale = (wf.abs().amax(-1) / INT8_MAX).clamp_min(1e-12)
    q = torch.round(wf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_rows(q_OI: torch.Tensor, scale_O: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q_OI.float() * scale_O[:, None]).to(dtype)


class QuantizedLinear(nn.Module):
    """Drop-in for a bias-free `nn.Linear` holding int8 or fp8 weights with a scale per output feature."""

    # merged projections (model/layers.py MergedLinear): q / k / v or gate / up rows with their per-row scales,
    # concatenated, run as one product by `linear_with`
    MERGE_FIELDS = ("weight_q", "weight_scale")

    def __init__(self, in_features: int, out_features: int, fmt: str = "int8", device=None):
        super().__init__()
        if fmt not in LINEAR_FORMATS[1:]:
            raise ValueError(f"unknown linear weight format {fmt!r}; use one of {LINEAR_FORMATS[1:]}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        # the kernel: "auto" (Triton where it runs, checked on first use), "triton" (unchecked), "scaled_mm" / "w8a8"
        # (fp8 weights and activations), "torch"; with the Triton kernel's tiles. Chosen by kernels.select.
        self.backend, self.tiles, self.tiles_spec = "auto", DEFAULT_LINEAR_TILES, DEFAULT_LINEAR_SPEC
        dtype = torch.int8 if fmt == "int8" else FP8
        self.register_buffer("weight_q", torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, fmt: str = "int8", backend: str = "auto") -> "QuantizedLinear":
        if lin.bias is not None:
            raise ValueError("QuantizedLinear holds bias-free projections only")
        m = cls(lin.in_features, lin.out_features, fmt, device=lin.weight.device)
        m.weight_q, m.weight_scale = quantize_int8_rows(lin.weight) if fmt == "int8" else quantize_fp8(lin.weight)
        m.backend = backend
        return m

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, backend={self.backend}"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight_q, self.weight_scale, self.fmt, dtype)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def resolved_backend(self, x: torch.Tensor) -> str:
        return linear_backend(self.backend, self.fmt, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training beside frozen 8-bit weights (LoRA)
            return _QuantLinearFn.apply(x, self)
        return self.linear_with(x, self.weight_q, self.weight_scale)

    def linear_with(self, x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        """x @ (weight_q * weight_scale)^T through this module's kernel, without autograd: its own weight (`forward`)
        or merged rows holding it."""
        if torch.compiler.is_compiling():  # a compiled block: one call of the custom op (the same function)
            if linear_backend(self.backend, self.fmt, x) in ("triton-a8", "torch-a8") and traced_fp8_rows(x):
                # w8a8: the rows quantised in traced torch, which the compiler fuses into the kernel that made x
                # (the norm before q/k/v and gate/up, the activation before down), then the product as one op
                xq, xs = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
                out = linear_a8_op(xq, xs, weight_q, weight_scale, x.dtype, self.backend, self.tiles_spec)
                return out.view(*x.shape[:-1], weight_q.shape[0])
            return linear_q_op(x, weight_q, weight_scale, self.fmt, self.backend, self.tiles_spec)
        return linear_q(x, weight_q, weight_scale, self.fmt, self.backend, self.tiles, self.tiles_spec)


def dequantize_rows(q_OI: torch.Tensor, scale_O: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(q_OI, scale_O, dtype) if fmt == "fp8" else dequantize_int8_rows(q_OI, scale_O, dtype)


A8_BACKENDS = ("w8a8", "triton-a8", "torch-a8")  # fp8 weights with fp8 activations (int8: "w8a8" runs "auto")


def linear_backend(backend: str, fmt: str, x: torch.Tensor) -> str:
    """What a `QuantizedLinear.backend` runs on x's device: "triton", "scaled_mm" or "torch"; with fp8 weights,
    "w8a8" (fp8 activations too) runs "triton-a8" (the kernel, on a CUDA GPU with fp8 tensor cores) or "torch-a8"
    (its reference, `linear_fp8_w8a8_reference`); asked by name, "triton-a8" is the kernel anywhere Triton runs (its
    interpreter on a CPU) and "torch-a8" the reference anywhere. int8 weights take "w8a8" as "auto": the experts'
    choice, which the projections follow, quantises activations only where the weights are fp8."""
    if backend in A8_BACKENDS:
        if fmt == "fp8":
            runs = backend != "torch-a8" and (backend == "triton-a8" or x.is_cuda) and fp8_usable_on(x.device)
            return "triton-a8" if runs else "torch-a8"
        if backend != "w8a8":
            raise ValueError(f"the {backend} linear backend (fp8 activations) needs fp8 weights, not {fmt}")
        backend = "auto"
    if backend == "scaled_mm" and fmt == "fp8":
        return "scaled_mm"
    if backend == "triton" or (backend == "auto" and x.is_cuda):
        if (fp8_usable_on if fmt == "fp8" else usable_on)(x.device):
            return "triton"
    return "torch"


def linear_q(x: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor, fmt: str, backend: str, tiles: dict,
             tiles_spec: str) -> torch.Tensor:
    """`QuantizedLinear.forward` without autograd, as a function of its weight and settings (what its custom op
    runs): the backend `linear_backend` resolves; "auto" on CUDA is the Triton kernel checked against the torch
    path on its first call per device, dtype and compiled variant."""
    which = linear_backend(backend, fmt, x)
    if which == "torch":
        return F.linear(x, dequantize_rows(q_OI, scale_O, fmt, x.dtype))
    if which == "torch-a8":
        return linear_fp8_w8a8_reference(x, q_OI, scale_O)
    if which == "scaled_mm":
        return linear_fp8_scaled_mm(x, q_OI, scale_O)
    a8 = which == "triton-a8"
    if backend in ("triton", "triton-a8"):  # asked for by name: the kernel, unchecked
        return linear_q_triton(x, q_OI, scale_O, **tiles, act8=a8)
    M = x.numel() // x.shape[-1]
    O, I = q_OI.shape
    what = f"triton {fmt}{' x fp8' if a8 else ''} linear"
    key = (str(x.device), str(x.dtype).removeprefix("torch."), what,
           (block_m_for(M, tiles.get("swap", False)), M == 1, M % 16 == 0, O % 16 == 0, I % 16 == 0, tiles_spec))
    reference = (lambda: linear_fp8_w8a8_reference(x, q_OI, scale_O)) if a8 else \
        (lambda: F.linear(x, dequantize_rows(q_OI, scale_O, fmt, x.dtype)))
    return checked_on_first_use(key, lambda: linear_q_triton(x, q_OI, scale_O, **tiles, act8=a8), reference,
                                f"the Triton {fmt}{' x fp8' if a8 else ''} linear kernel")


@torch.library.custom_op("blockpress::linear_q", mutates_args=())
def linear_q_op(x: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor, fmt: str, backend: str,
                tiles_spec: str) -> torch.Tensor:
    """`linear_q` as one opaque call in a compiled graph (kernels/library.py says why)."""
    return linear_q(x, q_OI, scale_O, fmt, backend, _tiles_of(tiles_spec), tiles_spec)


@linear_q_op.register_fake
def _(x, q_OI, scale_O, fmt, backend, tiles_spec):
    return x.new_empty(*x.shape[:-1], q_OI.shape[0])


@functools.lru_cache(maxsize=64)
def _tiles_of(spec: str) -> dict:
    return parse_linear_tiles(spec)


class _QuantLinearFn(torch.autograd.Function):
    """y = x W^T through the module's kernel, differentiable in x only: the backward dequantises W again
    (grad_x = grad_y W) rather than keeping a float copy of it from the forward pass."""

    @staticmethod
    def forward(ctx, x, lin: QuantizedLinear):
        ctx.lin = lin
        return lin.linear_with(x, lin.weight_q, lin.weight_scale)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None
        return grad @ ctx.lin.dequantize(grad.dtype), None


def linear_fp8_scaled_mm(x: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    """w8a8: x [..., I] quantised to fp8 per row, times the fp8 weight, both scales applied to the fp32
    accumulator by `torch._scaled_mm` (Hopper / Ada fp8 tensor cores; also runs on a CPU)."""
    lead, I = x.shape[:-1], x.shape[-1]
    xq, sa = quantize_rows_fp8(x.reshape(-1, I))
    try:
        out = torch._scaled_mm(xq, q_OI.t(), scale_a=sa[:, None], scale_b=scale_O[None, :], out_dtype=x.dtype)
    except RuntimeError:
        if x.is_cuda:
            raise
        # before torch 2.13 the CPU _scaled_mm takes per-tensor scales only (seen with 2.11): the same arithmetic
        return linear_fp8_w8a8_reference(x, q_OI, scale_O)
    return out.view(*lead, q_OI.shape[0])


def linear_fp8_w8a8_reference(x: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    """w8a8 in plain fp32 torch: x quantised to fp8 per row (`quantize_rows_fp8`), the fp8 x fp8 products summed in
    fp32 (each product exact), then scaled by the weight row's and the activation row's scales, rounded once to x's
    dtype. What `linear_fp8_scaled_mm` and the Triton kernel (`linear_q_triton(..., act8=True)`) compute up to the
    order of the fp32 sums; the "w8a8" backend's path where the kernel does not run."""
    lead, I = x.shape[:-1], x.shape[-1]
    xq, sa = quantize_rows_fp8(x.reshape(-1, I))
    return w8a8_product(xq, sa, q_OI, scale_O, x.dtype).view(*lead, q_OI.shape[0])


def w8a8_product(xq_MI: torch.Tensor, xs_M: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """fp8 rows [M, I] with their scales [M] times fp8 weights [O, I] with theirs [O] -> [M, O] in dtype: the fp8 x fp8
    products summed in fp32 (each exact), scaled by the weight row's then the activation row's scale, rounded once."""
    return ((xq_MI.float() @ q_OI.float().t()) * scale_O[None, :] * xs_M[:, None]).to(dtype)


def linear_a8(xq: torch.Tensor, xs: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor, dtype: torch.dtype,
              backend: str, tiles: dict, tiles_spec: str) -> torch.Tensor:
    """The w8a8 product of rows quantised already (xq fp8 [M, I], xs [M]: `quantize_rows_fp8`'s) through the backend
    `linear_backend` resolves for fp8 weights ("w8a8": the kernel on a CUDA GPU, checked on its first call against
    `w8a8_product`; the product elsewhere; "triton-a8" / "torch-a8" by name) -> [M, O] in dtype. What a compiled
    block's w8a8 projections run (`linear_a8_op`), the quantisation traced before it."""
    which = linear_backend(backend, "fp8", xq)
    if which != "triton-a8":
        return w8a8_product(xq, xs, q_OI, scale_O, dtype)
    if backend == "triton-a8":  # asked for by name: the kernel, unchecked
        return linear_q_triton(xq, q_OI, scale_O, **tiles, x_scale=xs, out_dtype=dtype)
    M, (O, I) = xq.shape[0], q_OI.shape
    key = (str(xq.device), str(dtype).removeprefix("torch."), "triton fp8 x fp8 linear, rows quantised",
           (block_m_for(M, tiles.get("swap", False)), M == 1, M % 16 == 0, O % 16 == 0, I % 16 == 0, tiles_spec))
    return checked_on_first_use(key, lambda: linear_q_triton(xq, q_OI, scale_O, **tiles, x_scale=xs, out_dtype=dtype),
                                lambda: w8a8_product(xq, xs, q_OI, scale_O, dtype),
                                "the Triton fp8 x fp8 linear kernel")


@torch.library.custom_op("blockpress::linear_a8", mutates_args=())
def linear_a8_op(xq: torch.Tensor, xs: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor, dtype: torch.dtype,
                 backend: str, tiles_spec: str) -> torch.Tensor:
    """`linear_a8` as one opaque call in a compiled graph."""
    return linear_a8(xq, xs, q_OI, scale_O, dtype, backend, _tiles_of(tiles_spec), tiles_spec)


@linear_a8_op.register_fake
def _(xq, xs, q_OI, scale_O, dtype, backend, tiles_spec):
    return xq.new_empty(xq.shape[0], q_OI.shape[0], dtype=dtype)


# ------------------------------------------------------------------------------------ Triton

BLOCK_N, BLOCK_K = 64, 64


def block_m_for(M: int, swap: bool = False) -> int:
    """16 for a one-token step, up to 64 for a canvas (256 rows) or a prompt; with swap (the rows are the MMA's N,
    up to 256) every row of a canvas in one block, so each weight is converted once."""
    if swap:
        return min(256, max(16, triton.next_power_of_2(M)))
    return 16 if M <= 16 else 32 if M <= 32 else 64


# The Triton kernel's tiles: block_m None = block_m_for(M); split_k: K split over that many programs whose fp32
# partial sums meet by atomic adds (more programs for the GPU's SMs: at 256 rows a 2112-wide projection has 4 x 33
# output tiles for 132 SMs, at one row 33), then one cast to the activation dtype. Another setting: the
# `linear_tiles` option (`blockpress bench --linear-tiles`); benchmarks/bench_linears.py times the variants.
DEFAULT_LINEAR_TILES = {"block_m": None, "block_n": BLOCK_N, "block_k": BLOCK_K, "num_warps": None, "split_k": 1,
                        "swap": False}


def parse_linear_tiles(spec: str) -> dict:
    """'bm=64,bn=32,bk=64,warps=4,split=4,swap=1' (any subset; bm=auto) -> DEFAULT_LINEAR_TILES' keys; ValueError
    naming the problem. swap=1: the weight tile as the dot's first operand (moe_grouped._dot), so a block of up to
    256 rows (wgmma's N) converts each weight once."""
    from .moe_grouped import parse_tiles

    split, rest = 1, []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, val = part.partition("=")
        if key.strip().lower() == "split":
            try:
                split = int(val)
            except ValueError:
                raise ValueError(f"linear tile setting split={val!r} is not an integer") from None
            if not 1 <= split <= 64:
                raise ValueError(f"split={split}: use 1 (no split) to 64")
        else:
            rest.append(part)
    t = parse_tiles(",".join(rest))
    if t.num_stages:
        raise ValueError("the linear kernel's stages are fitted to the device; drop 'stages=' from the spec")
    return {"block_m": t.block_m, "block_n": t.block_n if "bn=" in spec else BLOCK_N,
            "block_k": t.block_k if "bk=" in spec else BLOCK_K, "num_warps": t.num_warps, "split_k": split,
            "swap": t.swap}


def as_linear_tiles(spec: "str | dict | None") -> dict:
    """A spec string, a dict (any subset of the keys), or None (the defaults) -> the kernel's tiles."""
    return DEFAULT_LINEAR_TILES if spec is None else parse_linear_tiles(spec) if isinstance(spec, str) \
        else {**DEFAULT_LINEAR_TILES, **spec}


def linear_tiles_spec(t: dict) -> str:
    """The spec string of tiles (kept on each QuantizedLinear: its first-use key builds no string per call)."""
    parts = [f"bm={t['block_m'] or 'auto'}", f"bn={t['block_n']}", f"bk={t['block_k']}"]
    parts += [f"warps={t['num_warps']}"] if t["num_warps"] else []
    parts += [f"split={t['split_k']}"] if t["split_k"] > 1 else []
    parts += ["swap=1"] if t.get("swap") else []
    return ",".join(parts)


DEFAULT_LINEAR_SPEC = linear_tiles_spec(DEFAULT_LINEAR_TILES)


if triton is not None:

    @triton.jit
    def _linear_q_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, ks_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_qn,
                         stride_qk, stride_om, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr,
                         KSCALE: tl.constexpr, A8: tl.constexpr):
        """out[m, n] = scale[n] * sum_k x[m, k] q[n, k]. Programs that share an N block run side by side
        (axis 0 is M), so the weight tile they all read comes from L2 after the first. EVEN_K (BK divides K,
        every projection of the 26B model): no K mask. SPLIT > 1: program_id(2) sums K_SPLIT of K (a multiple
        of BK) and adds its scaled partial to out (fp32, zeroed) atomically. SWAP: the accumulator is [BN, BM],
        the weight tile the dot's first operand (moe_grouped._dot). stride_qk: 1 for a weight's rows (Triton
        specialises it, the code the projections always ran), or the row length of a weight read down its columns
        (the int8 embedding table [V, H] as the soft embedding's [H, V]). KSCALE: a scale per input column k too,
        applied to x in fp32 before the product's rounding to x's dtype (the table's per-token scales on the
        probabilities). A8 (fp8 weights, w8a8): x is fp8 with a scale per row (xs_ptr, moe_grouped._quant_rows), the
        dots take both fp8 tiles as they are (no weight converted) and both scales go on the fp32 accumulator."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        m = pid_m * BM + tl.arange(0, BM)
        n = pid_n * BN + tl.arange(0, BN)
        mmask, nmask = m < M, n < N
        acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
        k_lo = 0
        k_hi = K
        if SPLIT > 1:
            k_lo = tl.program_id(2) * K_SPLIT
            k_hi = tl.minimum(k_lo + K_SPLIT, K)
        for k0 in range(k_lo, k_hi, BK):
            k = k0 + tl.arange(0, BK)
            if EVEN_K:
                xmask, wmask = mmask[:, None], nmask[None, :]
            else:
                kmask = k < k_hi
                xmask, wmask = mmask[:, None] & kmask[None, :], kmask[:, None] & nmask[None, :]
            xa = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=xmask, other=0.0)
            if KSCALE:
                ks = tl.load(ks_ptr + k, mask=k < K, other=0.0)
                xa = (xa.to(tl.float32) * ks[None, :]).to(xa.dtype)
            if SWAP:  # [BN, BK] of q
                w = tl.load(q_ptr + n[:, None].to(tl.int64) * stride_qn + k[None, :] * stride_qk,
                            mask=tl.trans(wmask), other=0.0)
            else:  # [BK, BN] of q^T
                w = tl.load(q_ptr + n[None, :].to(tl.int64) * stride_qn + k[:, None] * stride_qk,
                            mask=wmask, other=0.0)
            if A8:
                acc = _dot8(xa, w, acc, F32, SWAP, BK)
            else:  # int8 and e4m3 values are exact in bf16 / fp16
                acc = _dot(xa, w.to(tl.float32).to(xa.dtype), acc, F32, SWAP)
        acc *= _cols(tl.load(s_ptr + n, mask=nmask, other=0.0), SWAP)
        if A8:  # each row's activation scale
            acc *= _rows(tl.load(xs_ptr + m, mask=mmask, other=0.0), SWAP)
        ptrs = out_ptr + _rows(m.to(tl.int64), SWAP) * stride_om + _cols(n, SWAP)
        mask = _rows(mmask, SWAP) & _cols(nmask, SWAP)
        if SPLIT > 1:
            tl.atomic_add(ptrs, acc, mask=mask)
        else:
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def linear_q_triton(x: torch.Tensor, q_OI: torch.Tensor, scale_O: torch.Tensor,
                    block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, split_k: int | None = None, swap: bool = False,
                    scale_I: torch.Tensor | None = None, act8: bool = False, x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., I] @ (q * scale)^T -> [..., O] in x's dtype, in one Triton kernel (q int8 or float8_e4m3fn).
    block_m: rows per program (default `block_m_for`). Each program converts its weight tile to the activation
    dtype, so M / block_m programs convert every weight: at a canvas (256 rows, BM 64) 4 times, ~20 instructions
    per weight on sm_90 (benchmarks/compile_report.py); BM 128 ~11.5 and BM 256 ~7.9, with a half and a quarter
    of the programs. block_n / block_k / num_warps / split_k: the other tiles (None: `DEFAULT_LINEAR_TILES`).
    split_k > 1 sums K in that many programs per output tile into an fp32 buffer (atomic
    adds: run-to-run last-bit differences), then casts: two more small kernels, for a grid that fills the GPU.
    swap: the weight tile as the dot's first operand (Hopper's wgmma reads it from registers; its M is block_n, so
    block_m may be a whole canvas, up to wgmma's N of 256, and each weight is converted once).
    q_OI may also be column-major (a transposed view, stride(0) == 1), and scale_I [I] a scale per input applied to
    x first (fp32, then x's dtype): the int8 embedding table's soft embedding, kernels/linear_q.py QuantizedEmbedding.
    act8 (fp8 weights): w8a8, x quantised to fp8 per row first (moe_grouped._quant_rows, one launch), then fp8 x fp8
    dots, no weight converted: `linear_fp8_w8a8_reference` computes the same up to the order of the fp32 sums.
    x_scale [..]: x is fp8 rows already quantised, these their scales (act8 without the quantising launch: what a
    compiled block runs, its quantisation fused into the op that made x), and out_dtype the output's dtype."""
    if triton is None:
        raise RuntimeError("linear_q_triton needs triton (pip install triton)")
    act8 = act8 or x_scale is not None or x.dtype == FP8
    if act8 and (q_OI.dtype != FP8 or scale_I is not None):
        raise ValueError("act8 (fp8 activations) needs fp8 weights and no per-input scale")
    dtype = out_dtype or x.dtype
    lead, I = x.shape[:-1], x.shape[-1]
    O = q_OI.shape[0]
    assert q_OI.shape[1] == I and 1 in q_OI.stride() and scale_O.shape == (O,), "weight [O, I], scale [O]"
    assert scale_I is None or scale_I.shape == (I,), "scale_I [I]"
    assert q_OI.stride(1) * I < 2 ** 31, "a column-major weight's column offsets must fit int32"
    x2 = x.reshape(-1, I)  # [M, I]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    t = DEFAULT_LINEAR_TILES
    bm = block_m or t["block_m"] or block_m_for(M, swap)
    bn, bk = block_n or t["block_n"], block_k or t["block_k"]
    warps, split = num_warps or t["num_warps"], split_k or t["split_k"]
    blocks_k = triton.cdiv(I, bk)
    split = max(1, min(split, blocks_k))
    k_split = triton.cdiv(blocks_k, split) * bk
    split = triton.cdiv(I, k_split)  # no empty split
    if M == 0:
        return torch.empty(*lead, O, dtype=dtype, device=x.device)
    out = torch.empty(M, O, dtype=dtype, device=x.device) if split == 1 else \
        torch.zeros(M, O, dtype=torch.float32, device=x.device)
    # fp32 operands: exact ieee dots; the interpreter needs them too (its bf16 tl.dot is wrong in triton 3.9)
    f32 = dtype == torch.float32 or interpreted()
    x_in, x_s = fp8_rows(x2, x_scale) if act8 else (x2, scale_O)  # what the kernel reads
    grid = (triton.cdiv(M, bm), triton.cdiv(O, bn), split)
    wgmma = runs_wgmma(bm, bn, swap, x.device)  # Hopper's wgmma keeps the converted weight tile in shared memory
    launch = _stages(None, (bm * x_in.element_size() + bn * q_OI.element_size()) * bk,
                     bn * bk * dtype.itemsize if wgmma and not act8 else 0, wgmma)
    if warps:
        launch["num_warps"] = warps
    _linear_q_kernel[grid](x_in, x_s, q_OI, scale_O, scale_O if scale_I is None else scale_I, out, M, O, I,
                           k_split, x_in.stride(0), q_OI.stride(0), q_OI.stride(1), out.stride(0), F32=f32, BM=bm,
                           BN=bn, BK=bk, EVEN_K=I % bk == 0, SPLIT=split, SWAP=bool(swap),
                           KSCALE=scale_I is not None, A8=act8, **launch)
    if split > 1:
        out = out.to(dtype)
    return out.view(*lead, O)


# ------------------------------------------------------------------------------------ module swap

def _swap(layer: nn.Module, part: str, name: str, fmt: str, backend: str) -> None:
    parent = getattr(layer, part)
    lin = getattr(parent, name, None)
    if isinstance(lin, nn.Linear):  # full-attention layers have no v_proj
        setattr(parent, name, QuantizedLinear.from_linear(lin, fmt, backend))


@torch.no_grad()
def quantize_linears_(module: nn.Module, fmt: str = "int8", backend: str = "auto") -> nn.Module:
    """Swap the attention and dense-MLP projections of every layer for QuantizedLinear, in place, one at a
    time (each float weight is freed before the next is quantised). Returns the module."""
    for layer in module.layers:
        for part, names in QUANTIZED_LINEARS.items():
            for name in names:
                _swap(layer, part, name, fmt, backend)
    return module


def linear_streaming_quantizer(module: nn.Module, fmt: str = "int8"):
    """A `load_weights(on_loaded=...)` hook: each projection is quantised as soon as its weight is in."""

    def on_loaded(name: str) -> None:
        m = LINEAR_WEIGHT.match(name)
        if m is not None and m.group(3) in QUANTIZED_LINEARS[m.group(2)]:
            _swap(module.layers[int(m.group(1))], m.group(2), m.group(3), fmt, "auto")

    return on_loaded


def quantized_linears(module: nn.Module) -> list[QuantizedLinear]:
    """The layers' 8-bit projections (not an 8-bit embedding table, `quantized_table`)."""
    return [m for m in module.modules() if type(m) is QuantizedLinear]


# ------------------------------------------------------------------------------------ the embedding table

SOFT_SLICE_BYTES = 32 << 20  # the reference soft embedding's converted slice of the table, at most (26B: 5,957 rows)
QUANTIZE_ROWS = 16384  # rows of the table quantised at a time (bounded fp32 temporaries: 185 MB on the 26B model)


class QuantizedEmbedding(QuantizedLinear):
    """The token embedding table in int8 with a scale per token (row): half the bytes of a bf16 table (1.48 -> 0.74
    GB on the 26B model) for its three uses, each a method, so the model never reads a float table:
    - the lookup (`forward(ids)`): the rows dequantised to the activation dtype;
    - the LM head (`head(h, rows)`): the table is also the output projection, [V, H] with a scale per output row, so
      this is a QuantizedLinear and the int8 linear kernel runs it (over a slice of the vocabulary), reading half the
      bytes;
    - the self-conditioning soft embedding (`soft(probs)`: probabilities [.., V] @ table): a product over the
      vocabulary, each token's scale on its probability. On a GPU the same int8 kernel reads the table down its
      columns (a transposed view: 1 byte a weight, the table read once); the reference (`soft_slices`, and a CPU)
      converts the int8 rows to the activation dtype (exact) in slices of at most SOFT_SLICE_BYTES and sums the
      slices' products in fp32.
    Inference only, like the other 8-bit weights (`lm_logits` dequantises the table for a gradient)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None):
        super().__init__(embedding_dim, num_embeddings, "int8", device=device)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self._unit: dict = {}  # device -> ones [H] (the soft embedding kernel's per-output scale)

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, emb: nn.Embedding) -> "QuantizedEmbedding":
        w = emb.weight
        m = cls(w.shape[0], w.shape[1], w.dtype, device=w.device)
        for r0 in range(0, w.shape[0], QUANTIZE_ROWS):
            m.weight_q[r0:r0 + QUANTIZE_ROWS], m.weight_scale[r0:r0 + QUANTIZE_ROWS] = \
                quantize_int8_rows(w[r0:r0 + QUANTIZE_ROWS])
        return m

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8, dtype={self.dtype}, backend={self.backend}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight_q[ids].float() * self.weight_scale[ids][..., None]).to(self.dtype)

    def head(self, h: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """h [..., H] @ table[rows]^T -> [..., rows] in h's dtype (the LM head's product, before the soft cap)."""
        return self.linear_with(h, self.weight_q[rows], self.weight_scale[rows])

    def soft(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., V] @ table -> [..., H] in probs' dtype: sum over v of (probs[v] * scale[v]) q[v]. On a GPU the
        int8 linear kernel reads the table down its columns (the table's one read, 1 byte a weight), the scales
        applied to the probabilities in registers; checked on first use against `soft_slices`, the reference (which
        also runs where a gradient flows through the probabilities: the kernel has no backward)."""
        grad = torch.is_grad_enabled() and probs.requires_grad
        if grad or linear_backend(self.backend, self.fmt, probs) != "triton":
            return self.soft_slices(probs)
        V, H = self.weight_q.shape
        unit = self._unit.get(probs.device)
        if unit is None:  # the kernel's per-output scale: none (made once per device, outside any graph capture)
            unit = self._unit[probs.device] = torch.ones(H, dtype=torch.float32, device=probs.device)

        def run():
            return linear_q_triton(probs, self.weight_q.t(), unit, scale_I=self.weight_scale, **self.tiles)

        if self.backend == "triton":  # asked for by name: the kernel, unchecked
            return run()
        M = probs.numel() // V
        key = (str(probs.device), str(probs.dtype).removeprefix("torch."), "triton int8 soft embedding",
               (block_m_for(M, self.tiles.get("swap", False)), M % 16 == 0, self.tiles_spec))
        return checked_on_first_use(key, run, lambda: self.soft_slices(probs), "the Triton int8 soft embedding")

    def soft_slices(self, probs: torch.Tensor) -> torch.Tensor:
        """`soft` in torch (the reference, and what runs on a CPU): the scales applied to the probabilities and the
        int8 rows converted to probs' dtype as they are (exact), a slice of the vocabulary at a time, the slices'
        products summed in fp32."""
        V, H = self.weight_q.shape
        flat = probs.reshape(-1, V)
        step = max(1, SOFT_SLICE_BYTES // (H * probs.element_size()))
        out = None
        for v0 in range(0, V, step):
            rows = slice(v0, v0 + step)
            part = (flat[:, rows] * self.weight_scale[rows]).to(probs.dtype) @ self.weight_q[rows].to(probs.dtype)
            out = part if out is None else (out.float() if out.dtype != torch.float32 else out).add_(part)
        return out.to(probs.dtype).view(*probs.shape[:-1], H)


def quantize_embeddings_(module: nn.Module) -> nn.Module:
    """Swap the model's embedding table for a QuantizedEmbedding, in place (kept if it is one). Returns the module."""
    if isinstance(module.embed_tokens, nn.Embedding):
        module.embed_tokens = QuantizedEmbedding.from_embedding(module.embed_tokens)
    return module


def embedding_streaming_quantizer(module: nn.Module):
    """A `load_weights(on_loaded=...)` hook: the embedding table is quantised as soon as it is in."""

    def on_loaded(name: str) -> None:
        if name == "embed_tokens.weight":
            quantize_embeddings_(module)

    return on_loaded
