"""Grouped MoE experts: every routed expert's weights are read once per call.

Shape legend: N tokens, H hidden, E experts, K top-k, A = N*K assignments, Im expert intermediate,
O output rows of a weight, BM/BN/BK tile sizes.

Same function as `model.moe.experts_loop` (the reference): for each (token, expert) assignment,
`down[e] @ (gelu_tanh(gate) * up)` with `gate, up = split(gate_up[e] @ x)`, weighted by the fp32
router weight, the K contributions summed in fp32 and cast once to the model dtype.

Two fast paths, both free of host synchronisation (fixed shapes, so a CUDA graph can hold them):
- `experts_grouped` (torch): assignments sorted by expert, two `torch._grouped_mm` calls (one
  launch each over all experts; CPU fallback: a per-expert loop), contributions un-sorted and
  summed over K (deterministic, no atomics).
- `experts_triton` (Triton, fused): tokens gathered inside the kernel, gate/up/GELU fused in the
  first kernel, the down projection in the second, the router-weighted sum over K in a third (fp32,
  like `combine`); weights may be plain, fp8 (per-channel scale) or packed int4 (group scales),
  dequantised in registers (see quant.py for the formats).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..model.layers import gelu_tanh
from ._triton import fp8_usable_on, interpreted, tl, triton, usable_on

# ------------------------------------------------------------------------------------ routing

def route_by_expert(idx_NK: torch.Tensor, n_experts: int):
    """Sort the A = N*K assignments by expert (stable) without host syncs.

    Returns order [A] (assignment ids in expert order), counts [E] int64, offs [E] int32
    (cumulative counts, the group ends `torch._grouped_mm` wants).
    """
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts, torch.cumsum(counts, 0).to(torch.int32)


def _grouped_mm_ok(device: torch.device, dtype: torch.dtype, widths: tuple[int, ...] = ()) -> bool:
    """Whether `torch._grouped_mm` runs here for `dtype`, and with rows of these widths (elements): it needs every
    row stride a multiple of 16 bytes ("strides should be multiple of 16 bytes" otherwise), so the experts' hidden
    and intermediate sizes (`experts_grouped` passes both GEMMs' in and out widths) must be multiples of 16 bytes'
    worth of elements, e.g. Im 12 is not in bf16 (24 bytes), nor Im 10 in fp32 (40)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(w * dtype.itemsize % 16 for w in widths):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    if device.type == "cuda":  # the fused CUTLASS kernel: Hopper and later, bf16
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False


def grouped_mm(x_AI: torch.Tensor, w_EOI: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group; row block g times w[g]^T. x [A, I], w [E, O, I] -> [A, O]."""
    if _grouped_mm_ok(x_AI.device, x_AI.dtype, w_EOI.shape[1:]) and x_AI.dtype == w_EOI.dtype:
        return torch._grouped_mm(x_AI, w_EOI.transpose(1, 2), offs=offs)  # w^T view is column-major, as required
    out = x_AI.new_empty(x_AI.shape[0], w_EOI.shape[1])
    start = 0
    for e, c in enumerate(counts.tolist()):  # fallback: one matmul per busy expert (host sync)
        if c:
            out[start:start + c] = x_AI[start:start + c] @ w_EOI[e].t()
            start += c
    return out


def combine(y_AH: torch.Tensor, order: torch.Tensor, w_NK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert-ordered outputs -> [N, H]: un-sort, weight in fp32, sum the K contributions in fp32."""
    N, K = w_NK.shape
    y = torch.empty_like(y_AH)
    y[order] = y_AH  # back to (token, k) order
    return (y.view(N, K, y.shape[-1]).float() * w_NK[..., None]).sum(1).to(dtype)  # (N = 0 too)


def experts_grouped(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI):
    """Torch fast path: two grouped matmuls over all experts, no host sync on Hopper/CPU."""
    K = idx_NK.shape[1]
    Im = down_EHI.shape[-1]
    order, counts, offs = route_by_expert(idx_NK, gate_up_EFH.shape[0])
    xs = x_NH[order // K]  # [A, H] token of each assignment, expert-major
    u = grouped_mm(xs, gate_up_EFH, counts, offs)  # [A, 2*Im], gate first
    a = gelu_tanh(u[:, :Im]) * u[:, Im:]
    y = grouped_mm(a, down_EHI, counts, offs)  # [A, H]
    return combine(y, order, w_NK, x_NH.dtype)


# ------------------------------------------------------------------------------------ Triton

FMT_PLAIN, FMT_FP8, FMT_INT4 = 0, 1, 2
INT4_MIN_K = 32  # an int4 K tile is two dots over its even and odd columns, each >= 16 (tl.dot's smallest K)


def align_blocks(idx_NK: torch.Tensor, n_experts: int, block_m: int):
    """Pad each expert's assignment list to a multiple of BM (vLLM's moe_align_block_size, in torch).

    Returns sorted_ids [L] (assignment ids; A marks padding), block_expert [L/BM] int32 (-1: unused
    block). L = A + E*(BM-1) rounded up to BM is fixed by the shapes, so no host sync is needed.
    """
    flat = idx_NK.reshape(-1)
    A, dev = flat.numel(), flat.device
    order, counts, _ = route_by_expert(idx_NK, n_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    pos = (pend - padded)[sorted_e] + torch.arange(A, device=dev) - start[sorted_e]
    L = -(-(A + n_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((L,), A, dtype=torch.int64, device=dev)
    sorted_ids[pos] = order
    block_start = torch.arange(0, L, block_m, device=dev)
    block_expert = torch.searchsorted(pend, block_start, right=True)
    block_expert = torch.where(block_expert >= n_experts, -1, block_expert).to(torch.int32)
    return sorted_ids, block_expert


ALIGN_MAX = 16384  # assignments `align_blocks_triton` takes in one program's registers (a batch of 8 canvases of 256)


def align_blocks_triton(idx_NK: torch.Tensor, n_experts: int, block_m: int):
    """`align_blocks` as one Triton launch (`_align_kernel`), for at most ALIGN_MAX assignments: the same outputs,
    exactly (tests/test_kernels.py)."""
    flat = idx_NK.reshape(-1)
    A = flat.numel()
    L = -(-(A + n_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.empty(L, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(L // block_m, dtype=torch.int32, device=flat.device)
    a_pad = max(triton.next_power_of_2(A), block_m)
    _align_kernel[(n_experts,)](flat, sorted_ids, block_expert, A, L, E=n_experts,
                                E_PAD=triton.next_power_of_2(n_experts), A_PAD=a_pad, BM=block_m, NB=2 * a_pad // block_m,
                                TAIL=1024, num_warps=min(16, max(4, a_pad // 1024)))  # sm_90: 4 warps spill at 16K
    return sorted_ids, block_expert


# int4 nibbles -> 16-bit floats MAGIC + n on the GPU, 4 packed bytes in $4 -> low nibbles in $0 (bytes 0, 1) and $1
# (bytes 2, 3), high nibbles in $2, $3: prmt spreads two bytes to two 16-bit lanes (z: zero bytes), lop3 0xEA is
# (lane & 0xF) | MAGIC, the exponent of 128 (bf16) or 1024 (fp16), whose mantissa step is 1
NIBBLE_ASM = """{{
            .reg .b32 t0, t1, z;
            mov.b32 z, 0;
            prmt.b32 t0, $4, z, 0x5140;
            prmt.b32 t1, $4, z, 0x5342;
            lop3.b32 $0, t0, 0x000F000F, {magic}, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, {magic}, 0xEA;
            shr.u32 t0, t0, 4;
            shr.u32 t1, t1, 4;
            lop3.b32 $2, t0, 0x000F000F, {magic}, 0xEA;
            lop3.b32 $3, t1, 0x000F000F, {magic}, 0xEA;
            }}"""

if triton is not None:
    NIBBLE_ASM_BF16 = tl.constexpr(NIBBLE_ASM.format(magic="0x43004300"))
    NIBBLE_ASM_F16 = tl.constexpr(NIBBLE_ASM.format(magic="0x64006400"))

    @triton.jit
    def _nibbles_16(b, ROUND: tl.constexpr):
        """uint8 [..] -> (low nibble, high nibble) as 16-bit floats MAGIC + n (NIBBLE_ASM; ROUND 1: bf16, 2:
        fp16), four bytes per asm block."""
        if ROUND == 1:
            return tl.inline_asm_elementwise(asm=NIBBLE_ASM_BF16, constraints="=r,=r,=r,=r,r", args=[b],
                                             dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(asm=NIBBLE_ASM_F16, constraints="=r,=r,=r,=r,r", args=[b],
                                             dtype=(tl.float16, tl.float16), is_pure=True, pack=4)

    @triton.jit
    def _load_w_tile(w_ptr, n, nmask, k0, KD, stride_n, stride_k, BK: tl.constexpr, EVEN_K: tl.constexpr,
                     SWAP: tl.constexpr):
        """Tile [BK, BN] of W^T (W is [O, KD], plain or fp8) for the K tile starting at k0, or [BN, BK] of W itself
        with SWAP (the weight as the dot's first operand, see _dot), as stored (the callers convert it; fp8's
        per-channel scale factors out of the dot product: the kernels apply it at the end). EVEN_K (BK divides KD):
        no K mask; a mask on K limits the vector loads to what Triton knows of KD's alignment (16 elements). int4
        tiles: _int4_halves."""
        k = k0 + tl.arange(0, BK)
        if SWAP:  # one return per function: Triton compiles both sides of a constexpr if that returns early
            m = nmask[:, None] if EVEN_K else nmask[:, None] & (k < KD)[None, :]
            w = tl.load(w_ptr + n[:, None] * stride_n + k[None, :] * stride_k, mask=m, other=0.0)
        else:
            m = nmask[None, :] if EVEN_K else (k < KD)[:, None] & nmask[None, :]
            w = tl.load(w_ptr + n[None, :] * stride_n + k[:, None] * stride_k, mask=m, other=0.0)
        return w

    @triton.jit
    def _int4_halves(w_ptr, n, nmask, k0, s_ptr, stride_n, stride_k, stride_sn, stride_sg,
                     GROUP: tl.constexpr, BK: tl.constexpr, ROUND: tl.constexpr, F32: tl.constexpr,
                     SWAP: tl.constexpr):
        """The int4 K tile at k0 as two dequantised halves [BK/2, BN] of W^T ([BN, BK/2] of W with SWAP): the even
        K columns (low nibbles) and the odd ones (high nibbles), each value the reference's (n - 8) * scale rounded
        once. The kernels take their dots with the even and odd columns of the activation tile, so the nibbles never
        need interleaving into K order (register shuffles on every weight); the activations, a few per thread, are
        split instead."""
        j = tl.multiple_of(k0 // 2, BK // 2) + tl.arange(0, BK // 2)
        b = tl.load(w_ptr + n[:, None] * stride_n + j[None, :] * stride_k, mask=nmask[:, None],
                    other=0)  # [BN, BK/2] uint8
        s = tl.load(s_ptr + n * stride_sn + (k0 // GROUP) * stride_sg, mask=nmask, other=0)
        DT: tl.constexpr = tl.bfloat16 if ROUND == 1 else tl.float16
        MAGIC: tl.constexpr = 0x4300 if ROUND == 1 else 0x6400  # bf16 128 / fp16 1024: MAGIC + n, mantissa step 1
        BIAS: tl.constexpr = 136.0 if ROUND == 1 else 1032.0  # MAGIC's value + 8
        if ROUND == 0:
            sf = s.to(tl.float32)[:, None]
            lo = ((b & 0xF).to(tl.int32) - 8).to(tl.float32) * sf
            hi = ((b >> 4).to(tl.int32) - 8).to(tl.float32) * sf
        elif F32:  # the interpreter: the same bit trick in Triton, the arithmetic in fp32, rounded to DT once
            sf = s.to(tl.float32)[:, None]
            lo = (((b & 0xF).to(tl.uint16) | MAGIC).to(DT, bitcast=True).to(tl.float32) - BIAS) * sf
            hi = (((b >> 4).to(tl.uint16) | MAGIC).to(DT, bitcast=True).to(tl.float32) - BIAS) * sf
            lo, hi = lo.to(DT).to(tl.float32), hi.to(DT).to(tl.float32)
        else:
            lo, hi = _nibbles_16(b, ROUND)
            sd = s.to(DT)[:, None]
            lo, hi = (lo - BIAS) * sd, (hi - BIAS) * sd  # n - 8 exact, one rounding of n * s
        if not SWAP:
            lo, hi = tl.trans(lo), tl.trans(hi)
        return lo, hi

    @triton.jit
    def _dot(x, w, acc, F32: tl.constexpr, SWAP: tl.constexpr):
        """acc + x [BM, BK] @ w [BK, BN] -> [BM, BN]; with SWAP, acc + w [BN, BK] @ x^T -> [BN, BM], the same numbers
        transposed. SWAP makes the weight tile (converted from fp8 / int4 in registers) the MMA's first operand, which
        Hopper's wgmma reads from registers (the second always comes from shared memory), and lets a block of 16-32
        assignments (one expert's at batch 1) use wgmma at all: its M is the weight rows (>= 64), not the tokens."""
        if F32:
            if SWAP:
                out = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                out = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif SWAP:
            out = tl.dot(w, tl.trans(x), acc)
        else:
            out = tl.dot(x, w, acc)
        return out

    @triton.jit
    def _dot8(x, w, acc, F32: tl.constexpr, SWAP: tl.constexpr, BK: tl.constexpr):
        """`_dot` for fp8 x fp8 tiles (A8) with every K tile's sum added to the fp32 accumulator in full precision
        (max_num_imprecise_acc = BK: Hopper's fp8 MMAs otherwise keep a narrower accumulator across the whole K loop,
        ~14 bits, and lose low bits of long sums, which DeepSeek-V3's fp8 GEMMs promote every 128 for)."""
        if F32:
            out = _dot(x, w, acc, F32, SWAP)
        elif SWAP:
            out = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BK)
        else:
            out = tl.dot(x, w, acc, max_num_imprecise_acc=BK)
        return out

    @triton.jit
    def _cols(v, SWAP: tl.constexpr):
        """A vector over the tile's output columns (BN), shaped to broadcast against the accumulator."""
        if SWAP:
            out = v[:, None]
        else:
            out = v[None, :]
        return out

    @triton.jit
    def _rows(v, SWAP: tl.constexpr):
        """A vector over the tile's assignments (BM), shaped to broadcast against the accumulator."""
        if SWAP:
            out = v[None, :]
        else:
            out = v[:, None]
        return out

    @triton.jit
    def _moe_up_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, sorted_ptr, bexp_ptr, act_ptr, A, H, Im, TOPK,
                       stride_xn, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg, stride_am,
                       FMT: tl.constexpr, GROUP: tl.constexpr, F32: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                       ROUND: tl.constexpr, SWAP: tl.constexpr, A8: tl.constexpr):
        """act[row] = gelu_tanh(x W_gate^T) * (x W_up^T) for the BM assignments of one expert block (the
        accumulators [BM, BN], or [BN, BM] with SWAP: _dot). A8 (fp8 weights): x is fp8 with a scale per token
        (xs_ptr, `_quant_rows_kernel`), the dots take both fp8 tiles as they are (no weight converted) and both
        scales are applied to the fp32 accumulators."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(bexp_ptr + pid_m)
        if e < 0:
            return
        rows = pid_m * BM + tl.arange(0, BM)
        ids = tl.load(sorted_ptr + rows)
        valid = ids < A
        tok = ids // TOPK
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < Im
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        ACC: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
        acc_g = tl.zeros(ACC, dtype=tl.float32)
        acc_u = tl.zeros(ACC, dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            xmask = valid[:, None] if EVEN_K else valid[:, None] & (k < H)[None, :]
            xa = tl.load(x_ptr + tok[:, None] * stride_xn + k[None, :], mask=xmask, other=0.0)
            if FMT == 2:  # int4: even and odd K columns apart (see _int4_halves)
                xe, xo = tl.split(tl.reshape(xa, (BM, BK // 2, 2)))
                glo, ghi = _int4_halves(w_e, n, nmask, k0, s_e, stride_wn, stride_wk, stride_sn, stride_sg, GROUP,
                                        BK, ROUND, F32, SWAP)
                ulo, uhi = _int4_halves(w_e, n + Im, nmask, k0, s_e, stride_wn, stride_wk, stride_sn, stride_sg,
                                        GROUP, BK, ROUND, F32, SWAP)
                acc_g = _dot(xo, ghi, _dot(xe, glo, acc_g, F32, SWAP), F32, SWAP)
                acc_u = _dot(xo, uhi, _dot(xe, ulo, acc_u, F32, SWAP), F32, SWAP)
            else:
                wg = _load_w_tile(w_e, n, nmask, k0, H, stride_wn, stride_wk, BK, EVEN_K, SWAP)
                wu = _load_w_tile(w_e, n + Im, nmask, k0, H, stride_wn, stride_wk, BK, EVEN_K, SWAP)
                if A8:
                    acc_g = _dot8(xa, wg, acc_g, F32, SWAP, BK)
                    acc_u = _dot8(xa, wu, acc_u, F32, SWAP, BK)
                else:  # bf16 / e4m3 values: exact in the activation dtype
                    wg, wu = wg.to(tl.float32).to(xa.dtype), wu.to(tl.float32).to(xa.dtype)
                    acc_g = _dot(xa, wg, acc_g, F32, SWAP)
                    acc_u = _dot(xa, wu, acc_u, F32, SWAP)
        if FMT == 1:  # fp8: the per-output-channel scale factors out of the dot product
            acc_g *= _cols(tl.load(s_e + n * stride_sn, mask=nmask, other=0.0), SWAP)
            acc_u *= _cols(tl.load(s_e + (n + Im) * stride_sn, mask=nmask, other=0.0), SWAP)
        if A8:  # each token's activation scale
            xs = _rows(tl.load(xs_ptr + tok, mask=valid, other=0.0), SWAP)
            acc_g *= xs
            acc_u *= xs
        inner = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
        act = 0.5 * acc_g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0)) * acc_u
        tl.store(act_ptr + _rows(rows, SWAP) * stride_am + _cols(n, SWAP), act.to(act_ptr.dtype.element_ty),
                 mask=_cols(nmask, SWAP))

    @triton.jit
    def _moe_down_kernel(act_ptr, as_ptr, w_ptr, s_ptr, sorted_ptr, bexp_ptr, out_ptr, rw_ptr, A, H, Im, TOPK,
                         stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg, stride_on,
                         FMT: tl.constexpr, GROUP: tl.constexpr, F32: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                         ATOMIC: tl.constexpr,
                         ROUND: tl.constexpr, SWAP: tl.constexpr, A8: tl.constexpr):
        """out[assignment] = act W_down^T in the activation dtype (rounded there, as the torch paths round each
        expert's output), one row per assignment; the router weights are applied by _moe_sum_kernel. ATOMIC: the
        weighted sum over the K assignments of a token is done here instead, added in fp32 into out[token] (each
        output rounded first to the activation dtype, ROUND 1: bf16, 2: fp16, as the torch paths round it; the
        order of the K additions is the GPU's, so the last bit of the sum may differ from run to run). SWAP: the
        accumulator is [BN, BM] (_dot). A8: the activations are fp8 with a scale per row (as_ptr), as in the up
        kernel."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(bexp_ptr + pid_m)
        if e < 0:
            return
        rows = pid_m * BM + tl.arange(0, BM)
        ids = tl.load(sorted_ptr + rows)
        valid = ids < A
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < H
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
        for k0 in range(0, Im, BK):
            k = k0 + tl.arange(0, BK)
            amask = valid[:, None] if EVEN_K else valid[:, None] & (k < Im)[None, :]
            a = tl.load(act_ptr + rows[:, None] * stride_am + k[None, :], mask=amask, other=0.0)
            if FMT == 2:
                ae, ao = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
                wlo, whi = _int4_halves(w_e, n, nmask, k0, s_e, stride_wn, stride_wk, stride_sn, stride_sg, GROUP,
                                        BK, ROUND, F32, SWAP)
                acc = _dot(ao, whi, _dot(ae, wlo, acc, F32, SWAP), F32, SWAP)
            else:
                w = _load_w_tile(w_e, n, nmask, k0, Im, stride_wn, stride_wk, BK, EVEN_K, SWAP)
                if A8:
                    acc = _dot8(a, w, acc, F32, SWAP, BK)
                else:
                    acc = _dot(a, w.to(tl.float32).to(a.dtype), acc, F32, SWAP)
        if FMT == 1:
            acc *= _cols(tl.load(s_e + n * stride_sn, mask=nmask, other=0.0), SWAP)
        if A8:
            acc *= _rows(tl.load(as_ptr + rows, mask=valid, other=0.0), SWAP)
        mask = _rows(valid, SWAP) & _cols(nmask, SWAP)
        if ATOMIC:
            if ROUND == 1:
                acc = acc.to(tl.bfloat16).to(tl.float32)
            elif ROUND == 2:
                acc = acc.to(tl.float16).to(tl.float32)
            rw = tl.load(rw_ptr + ids, mask=valid, other=0.0)
            tok = ids // TOPK
            tl.atomic_add(out_ptr + _rows(tok, SWAP) * stride_on + _cols(n, SWAP), acc * _rows(rw, SWAP), mask=mask)
        else:
            tl.store(out_ptr + _rows(ids, SWAP) * stride_on + _cols(n, SWAP), acc.to(out_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _align_kernel(idx_ptr, sorted_ptr, bexp_ptr, A, L, E: tl.constexpr, E_PAD: tl.constexpr,
                      A_PAD: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, TAIL: tl.constexpr):
        """`align_blocks` in one launch, one program per expert j: every program reads all A expert ids and counts
        them per expert (histogram; the A_PAD - A padding lanes count as expert 0 and are taken off again), so it
        knows where expert j's padded run starts; it writes j's assignment ids in increasing order (a running count
        of its matches), A into the run's padding and j into block_expert for the run's blocks. Program 0 also
        fills the slots and blocks past the last run (A, -1). Replaces ~12 launches a layer, a radix sort among
        them (0.9 ms a step on an H100)."""
        j = tl.program_id(0)
        a = tl.arange(0, A_PAD)
        e = tl.load(idx_ptr + a, mask=a < A, other=0).to(tl.int32)
        bins = tl.arange(0, E_PAD)
        counts = tl.histogram(e, E_PAD) - tl.where(bins == 0, A_PAD - A, 0)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        start = tl.sum(tl.where(bins == j, ends - padded, 0))
        count = tl.sum(tl.where(bins == j, counts, 0))
        size = tl.sum(tl.where(bins == j, padded, 0))
        mine = (e == j) & (a < A)
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1
        tl.store(sorted_ptr + start + rank, a.to(tl.int64), mask=mine)
        pad = tl.arange(0, BM)
        tl.store(sorted_ptr + start + count + pad, tl.full((BM,), 0, tl.int64) + A, mask=count + pad < size)
        blk = tl.arange(0, NB)  # a run holds at most A assignments: NB >= A / BM + 1 blocks
        tl.store(bexp_ptr + start // BM + blk, tl.full((NB,), 0, tl.int32) + j, mask=blk * BM < size)
        if j == 0:  # past the last run: padding slots and unused blocks
            total = tl.sum(padded)
            for t0 in range(0, L, TAIL):
                t = t0 + tl.arange(0, TAIL)
                tl.store(sorted_ptr + t, tl.full((TAIL,), 0, tl.int64) + A, mask=(t >= total) & (t < L))
                tl.store(bexp_ptr + t // BM, tl.full((TAIL,), -1, tl.int32), mask=(t >= total) & (t < L) & (t % BM == 0))

    @triton.jit
    def _fp8_nearest(v):
        """fp32 values within +-448 rounded to the nearest float8_e4m3fn value (ties to even), still in fp32: adding
        and subtracting 1.5 * 2^23 quanta of the magnitude's binade rounds it to that quantum (fp32 addition rounds
        to nearest even); quanta of 2^(exponent - 3), at least 2^-9 (e4m3's subnormal step). The cast to fp8 after
        it is then exact on any backend (Triton's interpreter rounds some fp32 -> fp8 casts wrongly, 124.3 -> 64;
        compiled, the two additions become two fma.rn with an exact product: the same roundings)."""
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        magic = quantum * 12582912.0  # 1.5 * 2^23 quanta
        r = (tl.abs(v) + magic) - magic  # the magnitude, then v's sign bit (what rounds to zero keeps it: -0.0)
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, A, C, stride_x, stride_q, BLOCK: tl.constexpr,
                           IDS: tl.constexpr):
        """One row of x [R, C] per program -> fp8 q and its fp32 scale amax / 448 (clamped to 1e-12): the bytes of
        `quant.quantize_rows_fp8`. IDS: rows whose sorted assignment id is A (an expert block's padding) are
        skipped."""
        r = tl.program_id(0).to(tl.int64)
        if IDS:
            if tl.load(ids_ptr + r) >= A:
                return
        c = tl.arange(0, BLOCK)
        m = c < C
        x = tl.load(x_ptr + r * stride_x + c, mask=m, other=0.0).to(tl.float32)
        s = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), 448.0), 1e-12)  # IEEE division (a compiled `/` is not)
        v = _fp8_nearest(tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0))
        tl.store(q_ptr + r * stride_q + c, v.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + r, s)

    @triton.jit
    def _moe_sum_kernel(y_ptr, rw_ptr, out_ptr, H, K, BH: tl.constexpr):
        """out[token] = sum_k float(y[token * K + k]) * router_weight[token, k], in fp32, cast once (the torch
        paths' `combine`)."""
        t, pid_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        h = pid_h * BH + tl.arange(0, BH)
        hmask = h < H
        acc = tl.zeros((BH,), dtype=tl.float32)
        for k in range(0, K):
            y = tl.load(y_ptr + (t * K + k) * H + h, mask=hmask, other=0.0).to(tl.float32)
            acc += y * tl.load(rw_ptr + t * K + k)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=hmask)


def _scale_strides(scale: torch.Tensor | None):
    if scale is None:
        return 0, 0, 0
    if scale.dim() == 2:  # per-channel [E, O]
        return scale.stride(0), scale.stride(1), 0
    return scale.stride(0), scale.stride(1), scale.stride(2)  # groups [E, O, I/G]


def triton_supported(x: torch.Tensor, fmt: int = FMT_PLAIN, groups: tuple[int, int] = (0, 0)) -> bool:
    """tl.dot needs K tiles of >= 16; an int4 K tile must not straddle two scale groups and is dotted as two halves
    (even and odd K columns, _int4_halves), so its groups must hold 32 (group 16 runs the torch path); fp8 needs
    sm_89+."""
    if fmt == FMT_FP8:
        return fp8_usable_on(x.device)
    return usable_on(x.device) and (fmt != FMT_INT4 or all(g % INT4_MIN_K == 0 for g in groups))


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch settings of the two Triton expert kernels (the same for both).

    block_m None: `auto_block_m`, the smallest of 16..64 (16..128 on sm_90+, with 8 warps at 128 unless num_warps
    is set) that holds a busy expert's assignments in one block but for ~10 % in expectation. block_n is capped
    per kernel at the next power of two >= its output width (a small model's tiles). fp8 on Hopper has its own
    (`default_tiles`). The others were chosen on benchmarks/compile_report.py's static model of the 26B shapes on
    sm_90: BK 64 (not 32) halved the int4 instructions per weight (5.5-6.9 -> 4.3-5.0: instruction-bound ->
    memory-bound); BN 128 (not 64) cuts them further at batch 4 (int4 issue 3.29 -> 2.82 ms a step, bf16 1.49 ->
    1.00), matches BN 64 at batch 1 (704 = 5.5 x 128 wastes a half tile), and halves the activation re-reads from
    L2 (every N tile re-reads its M block's rows: int4 at batch 1 19.8 -> 16.1 GB of L2 -> SM traffic a step
    against 12.1 GB from HBM; at batch 4 42.6 -> 28.1); on an H100 at batch 1 no swapped int4 tile beat them.
    `benchmarks/sweep_moe_tiles.py` times a grid of them on one layer of a real config, and the `moe_tiles` option (`load(..., moe_tiles="bm=32,bn=128,bk=64,warps=8,stages=4")`, `blockpress bench
    --moe-tiles ...`) applies the winner."""

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 64
    num_warps: int | None = None  # None: Triton's default
    num_stages: int | None = None
    swap: bool = False  # the weight tile as the dot's first operand (`_dot`): fp8's default on Hopper (`default_tiles`)

    def spec(self) -> str:
        parts = [f"bm={self.block_m or 'auto'}", f"bn={self.block_n}", f"bk={self.block_k}"]
        parts += [f"warps={self.num_warps}"] if self.num_warps else []
        parts += [f"stages={self.num_stages}"] if self.num_stages else []
        parts += ["swap=1"] if self.swap else []
        return ",".join(parts)


_TILE_KEYS = {"bm": "block_m", "bn": "block_n", "bk": "block_k", "warps": "num_warps", "stages": "num_stages",
              "swap": "swap"}
DEFAULT_TILES = Tiles()
# fp8 experts where tl.dot is Hopper's wgmma: the weight tile as the MMA's first operand, converted in registers (swap),
# 64 weight rows x a K tile of 128. Timed on one real-shaped layer of the 26B model at batch 1 on an H100
# (benchmarks/results/2026-11-27-h100-stack.md): 0.377 ms, 69 % of the copy rate, against the defaults' 0.440 (59 %);
# at bm 16 0.361 (72 %), which bm=auto picks with swap (`auto_block_m`). int4 was slower swapped at every tile tried
# (0.328 ms at best against the defaults' 0.305), so it keeps the defaults, as do bf16 and the GPUs before sm_90.
FP8_WGMMA_TILES = Tiles(block_n=64, block_k=128, swap=True)


def default_tiles(precision: str, wgmma: bool) -> Tiles:
    """The expert kernels' tiles when none are asked for (`moe_tiles` None), by the experts' weight format
    ("native", "fp8", "int4") and whether tl.dot is Hopper's wgmma on the device (`_wgmma_target`)."""
    return FP8_WGMMA_TILES if precision == "fp8" and wgmma else DEFAULT_TILES


@functools.lru_cache(maxsize=64)  # the experts' custom op gets its tiles as a spec string on every call
def parse_tiles(spec: str) -> Tiles:
    """'bm=32,bn=128,bk=64,warps=8,stages=4' (any subset; bm=auto) -> Tiles; ValueError naming the problem."""
    values: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, val = part.partition("=")
        key = key.strip().lower()
        if key not in _TILE_KEYS or not val:
            raise ValueError(f"bad tile setting {part!r} in {spec!r}: use key=value pairs with keys "
                             f"{', '.join(_TILE_KEYS)}, e.g. 'bm=32,bn=128,bk=64,warps=8,stages=4'")
        if key == "bm" and val.strip() == "auto":
            values["block_m"] = None
            continue
        try:
            n = int(val)
        except ValueError:
            raise ValueError(f"tile setting {key}={val!r} is not an integer") from None
        if key in ("bm", "bn", "bk") and (n < 16 or n & (n - 1)):
            raise ValueError(f"{key}={n}: tile sizes must be powers of two >= 16 (tl.dot's smallest tile)")
        if key == "warps" and n not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"warps={n}: use 1, 2, 4, 8, 16 or 32")
        if key == "stages" and not 1 <= n <= 8:
            raise ValueError(f"stages={n}: use 1..8")
        if key == "swap" and n not in (0, 1):
            raise ValueError(f"swap={n}: use 0 or 1")
        values[_TILE_KEYS[key]] = bool(n) if key == "swap" else n
    return Tiles(**values)


def as_tiles(tiles: "Tiles | str | None") -> Tiles:
    """A spec string, a Tiles, or None (the defaults) -> Tiles."""
    return DEFAULT_TILES if tiles is None else parse_tiles(tiles) if isinstance(tiles, str) else tiles


WGMMA_TARGET: dict = {}  # Triton device -> does it compile tl.dot to Hopper's warpgroup MMA (sm_90+)


def _wgmma_target(device: torch.device | None = None) -> bool:
    """Does Triton compile tl.dot for this device as sm_90+ code (False in the interpreter)? A CUDA tensor's device
    is asked directly; otherwise Triton's current target (benchmarks/compile_report.py's stand-in driver)."""
    if interpreted() or triton is None:
        return False
    if device is not None and device.type == "cuda":
        key = ("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if key not in WGMMA_TARGET:  # asked once, outside any graph capture (the first call is a warm-up)
            WGMMA_TARGET[key] = torch.cuda.get_device_capability(key[1])[0] >= 9
        return WGMMA_TARGET[key]
    try:
        from triton.runtime.driver import driver
        dev = driver.active.get_current_device()
        if dev not in WGMMA_TARGET:
            target = driver.active.get_current_target()
            WGMMA_TARGET[dev] = target.backend == "cuda" and int(target.arch) >= 90
        return WGMMA_TARGET[dev]
    except Exception:  # no driver
        return False


def runs_wgmma(block_m: int, block_n: int, swap: bool, device: torch.device | None) -> bool:
    """Does a tile [block_m rows of activations, block_n of weights] take Hopper's wgmma on `device`? The MMA's M is
    its first operand's rows, which must be >= 64: the activations' block_m, or with swap (`_dot`) the weights'."""
    return (block_n if swap else block_m) >= 64 and _wgmma_target(device)


@functools.lru_cache(maxsize=256)
def expected_m_blocks(tokens: int, top_k: int, n_experts: int, block_m: int) -> float:
    """E[ceil(X / BM)]: the M blocks one expert's assignments take (`align_blocks` pads each expert's list to a
    multiple of BM; an expert with none takes none), X ~ Binomial(tokens, K / E), the count of an expert under
    uniform random top-K routing (random weights, as the benchmarks build; a trained router is less balanced,
    which only adds blocks). Each block dequantises and streams its expert's weights again."""
    p = min(1.0, top_k / n_experts)
    if p >= 1.0 or tokens <= 0:
        return float(-(-max(tokens, 0) // block_m))
    mean, sd = tokens * p, math.sqrt(tokens * p * (1 - p))
    hi = min(tokens, int(mean + 12 * sd) + 1)  # the mass beyond is < 1e-30
    lp, lq, lg = math.log(p), math.log1p(-p), math.lgamma(tokens + 1)
    return sum(math.exp(lg - math.lgamma(x + 1) - math.lgamma(tokens - x + 1) + x * lp + (tokens - x) * lq)
               * -(-x // block_m) for x in range(1, hi + 1))


M_TILES = (16, 32, 64, 128)  # the M tiles bm=auto picks from
SPLIT_BUDGET = 1.1  # bm=auto: the smallest M tile whose expected blocks per busy expert stay within this
SPLIT_BUDGET_SWAP = 1.5  # the same with swapped tiles (the activations are the MMA's N side, no minimum of 64 rows):
# fp8 at batch 1 on an H100, bm 16 (1.43 blocks per busy expert) ran 4 % faster than bm 32 (1.00)


@functools.lru_cache(maxsize=256)  # per layer and pass in eager mode: a sum over the binomial once per shape
def auto_block_m(tokens: int, top_k: int, n_experts: int, wgmma: bool = False, swap: bool = False) -> int:
    """The M tile for `tokens` routed to top-`top_k` of `n_experts`: the smallest of 16..64 (and 128 on sm_90+, where
    tl.dot is Hopper's warpgroup MMA) whose expected M blocks per busy expert (`expected_m_blocks`) stay within
    `SPLIT_BUDGET`, else the largest. Each M block of an expert dequantises its weights again: at a canvas of 256
    tokens with top-8 of 128 an expert gets 16 assignments on average, but more than 16 nearly half the time
    (Binomial(256, 1/16): 1.43 blocks of 16 per expert, 1.00 of 32), so the M tile is sized for the spread, not
    the mean. A wider tile costs more instructions per weight per block (compile_report.py, int4 on sm_90: 2.95 / 3.44
    up / down at BM 16, 3.38 / 4.03 at BM 32), far less than a second block. Before sm_90 the tile stops at 64: with
    mma.sync a 128-row tile takes twice the instructions per weight (sm_89 int4 9.7 -> 16.5 ms a step). swap: the
    weight tile is the MMA's first operand, and the budget `SPLIT_BUDGET_SWAP` (timed)."""
    tiles = [m for m in M_TILES if m <= (128 if wgmma else 64)]
    busy = 1.0 - (1.0 - min(1.0, top_k / n_experts)) ** max(tokens, 0)  # P(an expert gets an assignment)
    budget = SPLIT_BUDGET_SWAP if swap else SPLIT_BUDGET
    for m in tiles:
        if expected_m_blocks(tokens, top_k, n_experts, m) <= budget * max(busy, 1e-12):
            return m
    return tiles[-1]


def compiled_variant(idx_NK: torch.Tensor, n_experts: int, tiles: Tiles = DEFAULT_TILES,
                     moe_sum: str = "kernel") -> tuple:
    """What picks a separately compiled Triton kernel for these shapes beyond dtype and format: the tiles (the
    M tile as resolved here), Triton's specialisation of integer arguments (== 1, divisible by 16) for
    the assignment count, and how the K outputs are summed."""
    A = idx_NK.numel()
    bm = tiles.block_m or auto_block_m(idx_NK.shape[0], idx_NK.shape[1], n_experts, _wgmma_target(idx_NK.device),
                                       tiles.swap)
    return (tiles.spec(), bm, A == 1, A % 16 == 0, moe_sum)


UNWRITTEN_FILL: float | None = None  # tests set NaN: the value an output buffer starts with before its kernel
SUM_BLOCK = 1024  # hidden columns per program of the weighted sum over a token's K expert outputs
# How the Triton experts sum a token's K expert outputs (`moe_sum`): "kernel" (default: the down kernel writes each
# assignment's output, [A, H] in the activation dtype, and a third kernel weights and sums them in a fixed order,
# deterministic) or "atomic" (opt-in, the `moe_sum` option, `bench --moe-sum atomic`: the down kernel adds each
# weighted output into an fp32 [N, H] with atomics; the [A, H] buffer, 0.69 GB written and read a step on the 26B
# model, is gone, but the order of the K additions is the GPU's: the last bit of a sum, and so rarely a token, may
# differ between runs)


SMEM_LIMIT: dict = {}  # Triton device -> max shared memory per block (bytes), asked once


def _smem_limit() -> int | None:
    if interpreted():
        return None
    try:
        from triton.runtime.driver import driver
        dev = driver.active.get_current_device()
        if dev not in SMEM_LIMIT:
            SMEM_LIMIT[dev] = int(driver.active.utils.get_device_properties(dev)["max_shared_mem"])
        return SMEM_LIMIT[dev]
    except Exception:  # no driver: nothing to fit
        return None


def _stages(stages: int | None, per_stage: int, fixed: int = 0, wgmma: bool = False) -> dict:
    """Launch settings for the pipeline depth: the tiles' own setting if given, else Triton's default (3 stages)
    unless its shared memory would exceed the GPU's limit, then the most stages that fit. What Triton 3.9 asks
    for (read back from compiles of the expert kernels, benchmarks/compile_report.py): stages - 1 buffers of
    `per_stage` bytes with mma.sync, `stages` buffers with Hopper's wgmma (bm >= 64 on sm_90), plus `fixed`
    bytes outside the pipeline (fp8 / int4 weights: the converted operand tile). Unfitted, the sweep's
    bn=128,bk=128 needed 240 KB at bm 64 in bf16, and bn=256,bk=128 256 KB for fp8 at bm 128 (a prefill on an
    H100), over its 227 KB: they would not launch."""
    if stages is not None:
        return {"num_stages": stages}
    limit = _smem_limit()
    if limit is None:
        return {}

    def need(s: int) -> int:
        return fixed + (s if wgmma else max(s - 1, 1)) * per_stage

    if need(3) <= limit:
        return {}
    return {"num_stages": next((s for s in (2, 1) if need(s) <= limit), 1)}


def _fit_k(stages: int | None, per_k: int, fixed_per_k: int, wgmma: bool, block_k: int,
           min_k: int = 16) -> tuple[dict, int]:
    """(_stages' launch settings, the K tile) for a kernel whose pipeline stage takes per_k bytes of shared memory
    per unit of K (and fixed_per_k outside it): the K tile is halved (down to min_k) while even one stage would
    not fit the device, e.g. bf16 bn=256,bk=128 on an RTX 40xx (132 KB a stage, 99 KB allowed). Halving keeps a
    K tile dividing what it divided (the int4 scale groups, H, Im)."""
    limit = _smem_limit()
    while stages is None and limit is not None and block_k > min_k and (per_k + fixed_per_k) * block_k > limit:
        block_k //= 2
    return _stages(stages, per_k * block_k, fixed_per_k * block_k, wgmma), block_k


def int4_block_k(block_k: int, groups: tuple[int, int]) -> int:
    """The K tile the int4 kernels run for a requested one: at least INT4_MIN_K, halved until it sits inside one
    scale group."""
    block_k = max(block_k, INT4_MIN_K)
    while block_k > INT4_MIN_K and any(g % block_k for g in groups):
        block_k //= 2
    return block_k


def experts_triton(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI, *, fmt: int = FMT_PLAIN,
                   gate_up_scale=None, down_scale=None, groups: tuple[int, int] = (0, 0), inter: int | None = None,
                   block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                   tiles: Tiles | None = None, moe_sum: str = "kernel", act8: bool = False,
                   x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """Fused Triton experts. Plain weights: gate_up [E, 2Im, H], down [E, H, Im]. fp8: same shapes
    (float8_e4m3fn) with scales [E, O]. int4: packed uint8 [E, O, I/2] with scales [E, O, I/G].
    Tiles: explicit block_* arguments, else `tiles`, else the defaults. moe_sum: "kernel" or "atomic" (above).
    act8 (fp8 weights only): w8a8, the tokens and the up kernel's activations quantised to fp8 per row first
    (`_quant_rows_kernel`, one launch each), so both kernels' dots take fp8 x fp8 and no weight is converted
    (`quant.experts_w8a8_torch` is the reference). x_scale [N]: the tokens are fp8 rows quantised already, these their
    scales (act8 without the first quantising launch: a compiled block's path), and out_dtype the output's dtype."""
    if triton is None:
        raise RuntimeError("experts_triton needs triton (pip install triton)")
    act8 = act8 or x_scale is not None or x_NH.dtype == torch.float8_e4m3fn
    if act8 and fmt != FMT_FP8:
        raise ValueError("act8 (fp8 activations) needs fp8 expert weights")
    dtype = out_dtype or x_NH.dtype
    t = tiles or DEFAULT_TILES
    block_m = block_m if block_m is not None else t.block_m
    block_n = block_n if block_n is not None else t.block_n
    block_k = block_k if block_k is not None else t.block_k
    warps = {"num_warps": t.num_warps} if t.num_warps else {}
    N, H = x_NH.shape
    K = idx_NK.shape[1]
    E = gate_up_EFH.shape[0]
    Im = inter if inter is not None else down_EHI.shape[-1] * (2 if fmt == FMT_INT4 else 1)
    A = N * K
    if block_m is None:
        block_m = auto_block_m(N, K, E, _wgmma_target(x_NH.device), t.swap)
        if block_m == 128 and not t.num_warps:  # two warpgroups: 4 warps would hold 2 x 128 x BN fp32 accumulators
            warps = {"num_warps": 8}
    if fmt == FMT_INT4:
        block_k = int4_block_k(block_k, groups)
        assert all(g % block_k == 0 for g in groups), f"int4 groups must be multiples of {INT4_MIN_K}"
        # the kernels load int4 K tiles unmasked: a tile never runs past a row (groups divide H and Im)
        assert H % block_k == 0 and Im % block_k == 0, f"int4 groups {groups} must divide H={H} and Im={Im}"
    x = x_NH.contiguous()
    dummy = x.new_empty(1, 1, 1, dtype=torch.float32)
    x_in, x_scale = fp8_rows(x, x_scale) if act8 else (x, dummy)  # what the up kernel reads
    align = align_blocks_triton if A <= ALIGN_MAX else align_blocks
    sorted_ids, block_expert = align(idx_NK, E, block_m)
    L = sorted_ids.numel()
    act = x.new_empty(L, Im, dtype=dtype)  # [L, Im] activations in padded expert order
    # fp32 operands: exact ieee dots; the interpreter also needs them (its bf16 tl.dot is wrong in triton 3.9)
    f32 = dtype == torch.float32 or interpreted()
    gs, ds = gate_up_scale if gate_up_scale is not None else dummy, down_scale if down_scale is not None else dummy
    g_st, d_st = _scale_strides(gate_up_scale), _scale_strides(down_scale)
    # shared memory outside the pipeline (what _stages fits): with wgmma (bm >= 64 on sm_90) the converted tile of
    # fp8 / int4 weights, in the activation dtype (int4: a byte more per weight; read back from compiles)
    wgmma = runs_wgmma(block_m, block_n, t.swap, x.device)
    converted = 0 if fmt == FMT_PLAIN or act8 or not wgmma else dtype.itemsize + (1 if fmt == FMT_INT4 else 0)
    a_bytes = x_in.element_size()  # an activation tile's bytes per element (1 with act8)
    bn_up = min(block_n, max(16, triton.next_power_of_2(Im)))  # no wider than the output: a small model's tiles
    bn_dn = min(block_n, max(16, triton.next_power_of_2(H)))
    grid = (L // block_m, triton.cdiv(Im, bn_up))
    rnd = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)  # 16-bit activations: int4 dequant in that dtype
    min_k = INT4_MIN_K if fmt == FMT_INT4 else 16
    stages_up, bk_up = _fit_k(t.num_stages, block_m * a_bytes + 2 * bn_up * gate_up_EFH.element_size(),
                              converted * bn_up, wgmma, block_k, min_k)
    _moe_up_kernel[grid](x_in, x_scale, gate_up_EFH, gs, sorted_ids, block_expert, act, A, H, Im, K,
                         x_in.stride(0), gate_up_EFH.stride(0), gate_up_EFH.stride(1), gate_up_EFH.stride(2), *g_st,
                         act.stride(0), FMT=fmt, GROUP=max(groups[0], 1), F32=f32, BM=block_m, BN=bn_up, BK=bk_up,
                         EVEN_K=H % bk_up == 0, ROUND=rnd, SWAP=t.swap, A8=act8, **warps, **stages_up)
    act_in, act_scale = act, dummy  # what the down kernel reads
    if act8:  # the rows of expert-block padding (id A) are skipped: the down kernel never reads them
        act_in, act_scale = _quant_rows(act, sorted_ids, A)
    rw = w_NK.reshape(-1).float().contiguous()
    grid = (L // block_m, triton.cdiv(H, bn_dn))
    stages_dn, bk_dn = _fit_k(t.num_stages, block_m * a_bytes + bn_dn * down_EHI.element_size(),
                              converted * bn_dn, wgmma, block_k, min_k)
    down = dict(FMT=fmt, GROUP=max(groups[1], 1), F32=f32, BM=block_m, BN=bn_dn, BK=bk_dn, EVEN_K=Im % bk_dn == 0,
                ROUND=rnd, SWAP=t.swap, A8=act8, **warps, **stages_dn)
    if moe_sum == "atomic":  # the weighted sum over K added into fp32 [N, H] by the down kernel itself
        acc = torch.zeros(N, H, dtype=torch.float32, device=x.device)
        _moe_down_kernel[grid](act_in, act_scale, down_EHI, ds, sorted_ids, block_expert, acc, rw, A, H, Im, K,
                               act_in.stride(0), down_EHI.stride(0), down_EHI.stride(1), down_EHI.stride(2), *d_st,
                               acc.stride(0), ATOMIC=True, **down)
        return acc.to(dtype)
    # per-assignment outputs in the activation dtype (bf16: 11.5 MB per layer of the 26B model at batch 1, not
    # fp32's 23 MB written and read again). Every (assignment, column) is stored by the down kernel (each
    # assignment id sits once in a used block), so the buffer needs no zero fill.
    y = torch.empty(A, H, dtype=dtype, device=x.device)
    if UNWRITTEN_FILL is not None:  # tests: poison the buffer, so an element the kernel misses shows up
        y.fill_(UNWRITTEN_FILL)
    _moe_down_kernel[grid](act_in, act_scale, down_EHI, ds, sorted_ids, block_expert, y, rw, A, H, Im, K,
                           act_in.stride(0), down_EHI.stride(0), down_EHI.stride(1), down_EHI.stride(2), *d_st,
                           y.stride(0), ATOMIC=False, **down)
    out = torch.empty(N, H, dtype=dtype, device=x.device)
    _moe_sum_kernel[(N, triton.cdiv(H, SUM_BLOCK))](y, rw, out, H, K, BH=SUM_BLOCK)
    return out


def fp8_rows(x_RC: torch.Tensor, x_scale: torch.Tensor | None = None):
    """The fp8 x fp8 kernels' input (act8): x [R, C] quantised to fp8 per row (`_quant_rows`), or, when x is fp8 rows
    already (a compiled block quantised them), x with its scales `x_scale` -> (fp8 [R, C], fp32 scales [R])."""
    if (x_scale is not None) != (x_RC.dtype == torch.float8_e4m3fn):
        raise ValueError("fp8 rows come with their scales (x_scale), and x_scale with fp8 rows")
    return _quant_rows(x_RC) if x_scale is None else (x_RC, x_scale.reshape(-1).contiguous())


def _quant_rows(x_RC: torch.Tensor, ids: torch.Tensor | None = None, A: int = 0):
    """x [R, C] -> (fp8 [R, C], fp32 scales [R]) by `_quant_rows_kernel`, one launch (ids, A: skip the rows whose id
    is A or more; their outputs are left unwritten)."""
    R, C = x_RC.shape
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn, device=x_RC.device)
    scale = torch.empty(R, dtype=torch.float32, device=x_RC.device)
    _quant_rows_kernel[(R,)](x_RC, q, scale, ids if ids is not None else scale, A, C, x_RC.stride(0), q.stride(0),
                             BLOCK=triton.next_power_of_2(C), IDS=ids is not None)
    return q, scale


# ------------------------------------------------------------------------------------ checked on first use

# (device, dtype, what, ...) -> True (the fast kernel agreed with its torch reference) / False (it did not, or
# failed to compile or launch: the reference runs instead). Filled by `checked_on_first_use`.
FIRST_USE: dict = {}
FIRST_USE_TOL = {torch.float32: 1e-4}  # relative error; 16-bit activations: 2e-2


def checked_on_first_use(key: tuple, fast, reference, what: str, as_tensor=None) -> torch.Tensor:
    """fast() on this key's later calls if its first call agreed with reference() (relative Frobenius error
    within FIRST_USE_TOL; as_tensor: what of a result to compare, for results that are not one tensor), else
    reference() from then on, with one warning that says why. A compiled kernel
    that fails on an untried GPU (a Triton compile error, a wrong result) thus costs one reference
    computation, not a crash or wrong text. The first call synchronises the host once (the comparison):
    it runs before any CUDA-graph capture, in the capture's warm-up."""
    ok = FIRST_USE.get(key)
    if ok is True:
        return fast()
    if ok is False:
        return reference()
    ref = reference()
    try:
        out = fast()
        a, b = (out, ref) if as_tensor is None else (as_tensor(out), as_tensor(ref))
        err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
        tol = FIRST_USE_TOL.get(b.dtype, 2e-2)
        ok = err <= tol  # NaN: False
        why = f"its result differs from the torch path by {err:.2e} (relative; allowed {tol:.0e})"
    except Exception as e:  # noqa: BLE001 - any compile or launch failure means: use the reference
        ok, why = False, f"it failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    FIRST_USE[key] = ok
    if not ok:
        import warnings

        warnings.warn(f"blockpress: {what} is off on {key[0]} ({key[1]}): {why}. Using the torch path instead "
                      "(slower; please report this with your GPU and versions)", RuntimeWarning, stacklevel=3)
    return ref


def experts_triton_checked(x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI, tiles: Tiles = DEFAULT_TILES,
                           moe_sum: str = "kernel"):
    """`experts_triton`, checked against `experts_grouped` (or the padded batched path where grouped GEMMs do
    not run) on its first call per device, dtype and compiled variant: what "auto" picks on a CUDA GPU."""
    from ..model.moe import experts_dense

    ref = experts_grouped if _grouped_mm_ok(x_NH.device, x_NH.dtype, down_EHI.shape[1:]) else experts_dense
    args = (x_NH, w_NK, idx_NK, gate_up_EFH, down_EHI)
    key = (str(x_NH.device), str(x_NH.dtype).removeprefix("torch."), "triton experts",
           compiled_variant(idx_NK, gate_up_EFH.shape[0], tiles, moe_sum))
    return checked_on_first_use(key, lambda: experts_triton(*args, tiles=tiles, moe_sum=moe_sum), lambda: ref(*args),
                                "the Triton experts kernel")
