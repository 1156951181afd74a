"""Fused sampler arithmetic of one denoising step: one pass over the vocabulary per position.

Shape legend: B batch, C canvas length, V vocab, R = B*C rows.

From the decoder's fp32 logits `raw` [B, C, V] and the step temperature tau, one read of each
logit gives: z = raw / tau (written once, in the self-conditioning dtype), argmax(z), the entropy
of softmax(z) (online: running max m, S = sum e^(z-m), T = sum (z-m) e^(z-m), H = log S - T/S),
and a sample y ~ softmax(z) by Gumbel-max (argmax(z + g), g = -log(-log u)), which has the same
distribution as `torch.multinomial` but not the same random stream.

So this is the opt-in "fast" sampler (`sampler="fast"`; the engine's step, `engine/step.py`, calls it): the
default path (`blockpress.sampling`) stays exact (bit-identical to transformers under a seed); this one is tested
statistically (chi-square) and for exact argmax / 1e-5 entropy agreement. `fused_sample` runs the Triton kernel where Triton runs
(CUDA, or the interpreter on CPU when asked) and the same algorithm in torch otherwise.

`cap`: `raw` is the LM head's product before the final soft cap (any dtype; `lm_logits(capped=False)`), and the
pass applies the cap as it reads each logit, with the soft-cap kernel's arithmetic (kernels/softcap.py), so z, the
argmax, the entropy and the draw are those of the capped logits: the fp32 logits [B, C, V] are never written or
read (on the 26B model at batch 1, 268 MB written by the soft cap and read back here, a step).

`bias` ([B, 1, V] fp32: a request's `logit_bias`, zeros for rows without one) is added to the capped logits before the
temperature, in the same pass: z = (softcap(raw) + bias) / tau.
"""

from __future__ import annotations


import torch

from ..model.layers import softcap_logits
from ._triton import interpreted, tl, triton, usable_on

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _fused_sampler_kernel(raw_ptr, tau_ptr, seed_ptr, bias_ptr, y_ptr, a_ptr, h_ptr, z_ptr, R, V, VQ, stride_r,
                              stride_zr, cap, tau_rows, C, HAS_TAU: tl.constexpr, WRITE_Z: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_V: tl.constexpr, EVEN: tl.constexpr, FAST_LOG: tl.constexpr,
                              CAP: tl.constexpr, BIAS: tl.constexpr):
        """EVEN: every tile full (R % ROWS == 0, V % BLOCK_V == 0), no masks. FAST_LOG: the Gumbel noise's two logs
        by the hardware's lg2.approx (compiled only; the interpreter has no libdevice), not libdevice's ~12-FMA
        logf: noise for a draw, where 2^-22 of relative error is far below what a sample can show. CAP: raw is
        the product before the soft cap `cap`, applied here as `_softcap_kernel` does (libdevice's tanh compiled,
        the sigmoid form in the interpreter: the same bits as that kernel's output, then / tau). tau_rows: the rows
        each tau value serves (R: one for all; C: one per batch row, `tau` [B]). BIAS: bias_ptr holds a [B, V] fp32
        bias, batch row r // C's added to the capped logits before tau."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < R
        tau = tl.full((ROWS,), 1.0, tl.float32)
        if HAS_TAU:
            tau = tl.load(tau_ptr + rows // tau_rows, mask=rmask, other=1.0)
        seed = tl.load(seed_ptr)
        m = tl.full((ROWS,), -1.0e30, tl.float32)  # finite start: (m - m_new) * S stays 0, never nan
        s = tl.zeros((ROWS,), tl.float32)
        t = tl.zeros((ROWS,), tl.float32)
        best = tl.full((ROWS,), float("-inf"), tl.float32)
        best_i = tl.zeros((ROWS,), tl.int64)
        gbest = tl.full((ROWS,), float("-inf"), tl.float32)
        gbest_i = tl.zeros((ROWS,), tl.int64)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            if EVEN:
                mask = None
                z = tl.load(raw_ptr + rows[:, None].to(tl.int64) * stride_r + v[None, :]).to(tl.float32)
            else:
                mask = rmask[:, None] & (v < V)[None, :]
                z = tl.load(raw_ptr + rows[:, None].to(tl.int64) * stride_r + v[None, :], mask=mask,
                            other=float("-inf")).to(tl.float32)
            if CAP:
                zc = tl.math.div_rn(z, cap)
                if FAST_LOG:  # compiled: libdevice, as the soft-cap kernel
                    zc = libdevice.tanh(zc)
                else:
                    zc = 2.0 * tl.sigmoid(2.0 * zc) - 1.0
                z = zc * cap
                if not EVEN:
                    z = tl.where(mask, z, float("-inf"))
            if BIAS:
                bias_at = bias_ptr + (rows // C)[:, None].to(tl.int64) * V + v[None, :]
                z = z + (tl.load(bias_at) if EVEN else tl.load(bias_at, mask=mask, other=0.0))
            z = z / tau[:, None]
            if WRITE_Z:
                tl.store(z_ptr + rows[:, None].to(tl.int64) * stride_zr + v[None, :],
                         z.to(z_ptr.dtype.element_ty), mask=mask)
            cmax, carg = tl.max(z, axis=1, return_indices=True, return_indices_tie_break_left=True)
            best_i = tl.where(cmax > best, v0 + carg, best_i)  # strict: first maximum wins, like torch
            best = tl.maximum(best, cmax)
            m_new = tl.maximum(m, cmax)
            alpha = tl.exp(m - m_new)
            d = z - m_new[:, None]
            p = tl.exp(d)
            pd = tl.where(p > 0.0, p * d, 0.0)  # p = 0 (a masked element, a -inf logit): d = -inf, 0 * -inf = nan
            t = alpha * (t + (m - m_new) * s) + tl.sum(pd, axis=1)
            s = alpha * s + tl.sum(p, axis=1)
            m = m_new
            # Gumbel noise: one Philox call gives 4 uniforms (for v = 4i .. 4i + 3), not 1 of 4 kept
            iq = rows[:, None] * VQ + (v0 // 4 + tl.arange(0, BLOCK_V // 4))[None, :]
            u0, u1, u2, u3 = tl.rand4x(seed, iq)
            u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), (ROWS, BLOCK_V))
            if FAST_LOG:
                g = -libdevice.fast_logf(-libdevice.fast_logf(u))
            else:
                g = -tl.log(-tl.log(u))
            zg = z + g if EVEN else tl.where(mask, z + g, float("-inf"))
            gmax, garg = tl.max(zg, axis=1, return_indices=True, return_indices_tie_break_left=True)
            gbest_i = tl.where(gmax > gbest, v0 + garg, gbest_i)
            gbest = tl.maximum(gbest, gmax)
        tl.store(y_ptr + rows, gbest_i, mask=rmask)
        tl.store(a_ptr + rows, best_i, mask=rmask)
        tl.store(h_ptr + rows, tl.log(s) - t / s, mask=rmask)


def entropy_from_logits(z: torch.Tensor) -> torch.Tensor:
    """Same quantity as sampling.token_entropy, in the fused kernel's form (max-shifted)."""
    d = z - z.amax(-1, keepdim=True)
    p = d.exp()
    s = p.sum(-1)
    return s.log() - torch.where(p > 0, p * d, 0.0).sum(-1) / s  # (a -inf logit: p = 0, not 0 * -inf = nan)


def capped_logits(raw, cap=None, bias=None) -> torch.Tensor:
    """fp32 logits of the LM head's product `raw`: the reference soft cap `cap` applied into a new tensor (raw is
    left as it is, an fp32 model's too), then `bias` ([B, 1, V]) added; with neither, raw as fp32."""
    if cap:
        z = softcap_logits(raw, cap, out=torch.empty(raw.shape, dtype=torch.float32, device=raw.device))
        return z if bias is None else z.add_(bias)
    return raw.float() if bias is None else raw.float() + bias


def fused_sample_torch(raw, tau=None, generator=None, out_dtype=None, out=None, cap=None, bias=None):
    """The fused algorithm in plain torch (CPU fallback). Returns y, a, h [B,C] and z (out_dtype; written into
    `out` when given). cap: raw is the product before the soft cap; bias: added after it (`capped_logits`)."""
    z = capped_logits(raw, cap, bias)
    z = z if tau is None else z / tau
    u = torch.rand(z.shape, device=z.device, generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    y = torch.argmax(z - torch.log(-torch.log(u)), dim=-1)
    return y, torch.argmax(z, dim=-1), entropy_from_logits(z), z.to(out_dtype or z.dtype) if out is None else out.copy_(z)


def fused_sample_triton(raw, tau=None, seed=None, out_dtype=None, rows_per_program=None, block_v=None, out=None,
                        cap=None, bias=None):
    """One Triton pass over [R, V]. tau: an fp32 tensor of one value (0-dim) or one per batch row ([B, 1, 1]: rows at
    different steps of their schedules), or None; seed: int64 tensor [1] on device; out: a contiguous [B, C, V] tensor
    to write z into (its dtype wins over out_dtype); cap, bias ([B, 1, V] fp32): see the module docstring."""
    B, C, V = raw.shape
    R = B * C
    if tau is not None and tau.numel() not in (1, B):
        raise ValueError(f"tau must hold one temperature or one per row ({B}), got {tau.numel()}")
    if bias is not None and (bias.shape != (B, 1, V) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be an fp32 tensor of shape {[B, 1, V]}, got {bias.dtype} {list(bias.shape)}")
    x = raw.reshape(R, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev = raw.device
    if seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=dev)
    rows = rows_per_program or (1 if V >= 4096 else 16)
    bv = max(4, block_v or min(4096, triton.next_power_of_2(V)))  # >= 4: the noise comes 4 uniforms per call
    y = torch.empty(R, dtype=torch.int64, device=dev)
    a = torch.empty(R, dtype=torch.int64, device=dev)
    h = torch.empty(R, dtype=torch.float32, device=dev)
    if out is None:
        z = torch.empty(R, V, dtype=out_dtype or torch.float32, device=dev)
    elif out.shape != raw.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {list(raw.shape)}, got {list(out.shape)}")
    else:
        z = out.view(R, V)
    tau_t = tau.reshape(-1).contiguous() if tau is not None else h  # (h: an unused pointer when HAS_TAU is False)
    tau_rows = R if tau is None or tau.numel() == 1 else C
    bias_t = bias.contiguous() if bias is not None else h  # (h: an unused pointer when BIAS is False)
    _fused_sampler_kernel[(triton.cdiv(R, rows),)](x, tau_t, seed, bias_t, y, a, h, z, R, V, triton.cdiv(V, 4),
                                                   x.stride(0), z.stride(0), float(cap or 1.0), tau_rows, C,
                                                   HAS_TAU=tau is not None, WRITE_Z=True, ROWS=rows, BLOCK_V=bv,
                                                   EVEN=R % rows == 0 and V % bv == 0, FAST_LOG=not interpreted(),
                                                   CAP=bool(cap), BIAS=bias is not None)
    return y.view(B, C), a.view(B, C), h.view(B, C), z.view(B, C, V)


def fused_sample(raw, tau=None, generator=None, out_dtype=None, backend: str = "auto", out=None, cap=None, bias=None):
    """-> y (sample), a (argmax), h (entropy) [B,C] and z = (raw + bias) / tau in out_dtype [B,C,V] (written into
    `out`, a contiguous tensor, when given). cap: raw is the product before this soft cap, applied in the same pass
    (before the bias)."""
    use_triton = backend == "triton" or (backend == "auto" and raw.is_cuda and usable_on(raw.device))
    if use_triton:
        seed = torch.randint(0, 2**31 - 1, (1,), device=raw.device, generator=generator)
        return fused_sample_triton(raw, tau, seed, out_dtype, out=out, cap=cap, bias=bias)
    return fused_sample_torch(raw, tau, generator, out_dtype, out=out, cap=cap, bias=bias)
