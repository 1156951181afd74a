"""Attention of the fixed-shape passes in one Triton kernel (flash attention), reading K/V from the cache in place.

Shape legend: B batch, nh query heads, kv KV heads, G = nh / kv query heads per KV head, M = S + C query rows (an
encoder chunk of S at positions [T0, T0+S), then a canvas of C at [T0+S, T0+S+C)), P cache capacity, R a sliding
layer's slots (a ring, or P), W window, D head dim.

Why: the fixed-shape passes (model/keys.py `Fixed`: what CUDA graphs capture and compiled blocks run) give SDPA an
additive mask over the whole cache, or over a sliding window gathered from it (a copy), and with a mask SDPA takes
its memory-efficient kernel, whose tiles do not suit the 26B model's head dims (512 on the full layers, 8 query
heads per KV head; 256 on the sliding ones, 2 per KV head). A batch-1 denoising step spent 2.62 of its 21.7 ms in
attention on an H100 (benchmarks/results/2026-11-26-h100-compiled.md). Here one program takes BM rows of one KV
head's group, its G query heads side by side (row r: query r // G, head r % G), so each K/V tile it loads serves the
whole group; it loops over the keys those rows can see, read from the cache's buffers, with an online softmax in
fp32 (scaling exactly 1.0; P cast to the model dtype for the P @ V product, as the reference casts its
probabilities).

Visibility is index math, the rules of model/keys.py (`encoder_sees`, `decoder_sees`, causal encoder) written for a
row m of the pass: it sees the keys k in [lo_m, hi_m) that are valid (`cache.valid`, the padding mask) or were
written by this pass (k >= T0 + S: the canvas, never padding), where
- an encoder row (m < S, query at q = T0 + m): hi = q + 1, lo = q + 1 - W on a sliding layer;
- a canvas row (m >= S, T = T0 + S): hi = T + C, lo = T - (W - 1) on a sliding layer;
- on a full layer lo = 0.
Both bounds grow with m, so a program loops over [lo of its first row, hi of its last row), which on a sliding
layer is at most W - 1 + C keys however long the cache is, and never touches the keys past the pass. T0 is read
from its device tensor inside the kernel: the loop bounds follow a CUDA graph's replays. A sliding layer whose
cache keeps a ring (model/cache.py) holds position p in slot p % R; the loop runs over positions, loads slots. Every
row sees at least one key (its own position, or the canvas), so no row's softmax is empty; a bidirectional
encoder's rule is not written here (`Fixed` keeps its masks for such a model's encoder rows).

Same function as `model.layers.attention_eager` with the rules' mask up to fp32 summation order and the rounding
of P (tests/test_attention_kernel.py). `fixed_attention_torch` is the reference: the rules' mask over every slot
(the position each slot holds is computed from T0), through SDPA, what the first-use check compares with.

Tiles (`tiles_for`): the accumulator, BM rows x DV output columns in fp32, lives in registers, and a thread has
at most 255. Compiled for sm_90 (benchmarks/compile_report.py; ptxas's stack frame read as spills): at D = 512 a
whole row (BM = 64, 8 warps: 128 accumulator registers a thread) spilled 80-560 bytes a thread at every key tile
tried, with 16 warps more (128 registers a thread at most). So D = 512 splits the output's columns, DV = 256: two
programs per row block, each computing Q K^T over all 512 dims (the score work twice: 1.5x the arithmetic) and
P V for its half: 195 registers, no spill, BN = 32 keys a step, Q 64 KB + two pipeline stages of K (32 KB) and V
(16 KB) = 160 KB of shared memory (the H100 allows 227 KB). It also doubles the programs at batch 1: a full layer's
2 KV heads x 2,048 rows / 64 = 64 row blocks, 128 programs for the H100's 132 SMs. D = 256: whole rows, BM = 64,
BN = 64, 8 warps: 250 registers, no spill, 160 KB (64 programs a sliding layer at batch 1; DV = 128 would give 128
at 1.5x the arithmetic). These are what compiles without spilling, not the winners of a sweep: `blockpress tune`
times other tiles per kind of layer on the user's card (an attention tiles spec, `parse_attention_tiles`;
`Options.attention_tiles`). SPLIT = k (a tile setting, default 1; `Options.attention_split` sets it for every
layer) is flash-decoding's answer to few programs: each row block's key tiles in k runs, k times the programs, each
run writing its normalised fp32 output and log-sum-exp, which `_combine_kernel` merges (exp(lse_run - lse)
weights); no spill at k = 2 on sm_90, not yet timed. On an H100 the kernel took 2.58 ms of a batch-1 step against
SDPA's 2.62, yet the whole graphed step took 1.25 ms less with it, a gain the profile did not place (the SDPA path
also builds a mask over the cache and gathers the sliding window each pass;
benchmarks/results/2026-11-27-h100-stack.md).

On by default on Hopper, opt-in on other CUDA GPUs (`Options.attention_kernel_on`, `bench --attention-kernel`),
checked against the reference on its first use per device, dtype and variant (`fixed_attention_checked`);
`fixed_attention_op` is the custom op a compiled block calls (kernels/library.py says why).
"""

from __future__ import annotations

import functools
import types

import torch

from ..config import FULL, SLIDING
from ..model.keys import pass_sees
from ..model.layers import additive_mask
from ._triton import interpreted, tl, triton
from .attention import attention_sdpa_gqa
from .moe_grouped import checked_on_first_use

if triton is not None:

    @triton.jit
    def _fixed_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, t0_ptr, o_ptr, part_ptr, lse_ptr,
                                s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_om, s_oh, s_valid,
                                M, S, W, R,
                                KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                                BM: tl.constexpr, BN: tl.constexpr, SLIDING: tl.constexpr, RING: tl.constexpr,
                                F32: tl.constexpr, SPLIT: tl.constexpr):
        """Rows [pid * BM, pid * BM + BM) of KV head (b, h)'s group: out[b, m, h * G + j, c:c + DV] for row m * G + j
        (the output's columns c in D / DV programs side by side, each with the whole of Q K^T). SPLIT > 1: program
        (., ., sp) takes the sp-th of SPLIT runs of the key tiles and writes its normalised fp32 output and its
        log-sum-exp (-inf where its rows saw no key) to part / lse [SPLIT, B, M, nh, .]; `_combine_kernel` merges."""
        pid = tl.program_id(0) // (D // DV)
        c = (tl.program_id(0) % (D // DV)) * DV
        b = (tl.program_id(1) // KV).to(tl.int64)  # 64-bit row offsets: a batch of long caches passes 2^31 elements
        h = (tl.program_id(1) % KV).to(tl.int64)
        T0 = tl.load(t0_ptr).to(tl.int32)  # positions (and slots) fit 32 bits: the cache's capacity does
        r = pid * BM + tl.arange(0, BM)
        m = r // G
        head = h * G + r % G
        row_ok = m < M
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + m[:, None] * s_qm + d[None, :], mask=row_ok[:, None],
                    other=0.0)
        enc = m < S  # an encoder row (the chunk's); else a canvas row
        hi = tl.where(enc, T0 + m + 1, T0 + M)  # [BM]: one past the last key a row sees
        new = T0 + S  # keys from here on were written by this pass's canvas: never padding
        m_first = (pid * BM) // G
        m_last = tl.minimum((pid * BM + BM - 1) // G, M - 1)
        hi_t = tl.where(m_last < S, T0 + m_last + 1, T0 + M)  # the program's key range [lo_t, hi_t)
        if SLIDING:
            lo = tl.where(enc, T0 + m, new) + 1 - W
            lo_t = tl.maximum(tl.where(m_first < S, T0 + m_first, new) + 1 - W, 0)
        else:
            lo_t = 0
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, DV], tl.float32)
        dv = tl.arange(0, DV)
        n = tl.arange(0, BN)
        k_base = k_ptr + b * s_kb + h * s_kh
        v_base = v_ptr + b * s_vb + h * s_vh
        if SPLIT > 1:  # this program's run of the key tiles: the sp-th of SPLIT as even as whole tiles allow
            per = tl.cdiv(tl.cdiv(hi_t - lo_t, BN), SPLIT) * BN
            lo_t = lo_t + tl.program_id(2) * per
            hi_t = tl.minimum(hi_t, lo_t + per)
        for start in range(lo_t, hi_t, BN):
            kp = start + n  # positions
            inside = kp < hi_t
            slot = kp % R if RING else kp
            # the padding mask first (a plain load, not pipelined): its latency under the Q K^T product
            ok = (tl.load(valid_ptr + b * s_valid + kp, mask=inside, other=0) != 0) | (kp >= new)
            kt = tl.load(k_base + slot[:, None] * s_kn + d[None, :], mask=inside[:, None], other=0.0)
            if F32:
                s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kt))
            seen = (kp[None, :] < hi[:, None]) & ok[None, :]
            if SLIDING:
                seen = seen & (kp[None, :] >= lo[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: p = 0
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + slot[:, None] * s_vn + c + dv[None, :], mask=inside[:, None], other=0.0)
            if F32:
                acc = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), acc * alpha[:, None],
                             input_precision="ieee")
            else:
                acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if SPLIT > 1:  # [SPLIT, B, M, nh, D] fp32 and [SPLIT, B, M, nh], contiguous
            row = ((tl.program_id(2) * (tl.num_programs(1) // KV) + b) * M + m) * (KV * G) + head
            tl.store(part_ptr + row[:, None] * D + c + dv[None, :], out, mask=row_ok[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_ptr + row, lse, mask=row_ok)  # the D / DV programs of a row block write the same value
        else:
            tl.store(o_ptr + b * s_ob + m[:, None] * s_om + head[:, None] * s_oh + c + dv[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _combine_kernel(part_ptr, lse_ptr, o_ptr, N, D: tl.constexpr, BR: tl.constexpr, SPLIT: tl.constexpr):
        """out[r] = sum_s exp(lse[s, r] - L) part[s, r] with L = log(sum_s exp(lse[s, r])), for BR of the N rows
        (b, m, head) of the contiguous [B, M, nh, D] output."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        ok = r < N
        d = tl.arange(0, D)
        top = tl.full([BR], float("-inf"), tl.float32)
        for sp in tl.static_range(SPLIT):
            top = tl.maximum(top, tl.load(lse_ptr + sp * N + r, mask=ok, other=float("-inf")))
        top = tl.where(top == float("-inf"), 0.0, top)  # rows past N (every row saw a key in some run)
        total = tl.zeros([BR], tl.float32)
        acc = tl.zeros([BR, D], tl.float32)
        for sp in tl.static_range(SPLIT):
            w = tl.exp(tl.load(lse_ptr + sp * N + r, mask=ok, other=float("-inf")) - top)
            total += w
            acc += w[:, None] * tl.load(part_ptr + (sp * N + r)[:, None] * D + d[None, :], mask=ok[:, None],
                                        other=0.0)
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(o_ptr + r[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=ok[:, None])


def tiles_for(D: int, itemsize: int = 2) -> dict:
    """(BM, BN, num_warps, num_stages) for head dim D and q's element size: module docstring. The interpreter: small
    tiles (its time goes with the number of programs and loop steps, not their size, but the tests' tiny caches want
    several key tiles). Compiled, the GPU's (also for CPU tensors: benchmarks/compile_report.py's compiles); fp32
    (tests) at D = 512 stages K/V once: two stages need 237,824 B of shared memory, over sm_90's 232,448."""
    if interpreted():
        return {"BM": 16, "BN": 16}
    if D >= 512:
        return {"BM": 64, "BN": 32, "DV": 256, "num_warps": 8, "num_stages": 1 if itemsize >= 4 else 2}
    if D >= 256:
        return {"BM": 64, "BN": 64, "num_warps": 8, "num_stages": 2}
    return {"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 3}


TILE_KEYS = {"bm": "BM", "bn": "BN", "dv": "DV", "split": "SPLIT", "warps": "num_warps", "stages": "num_stages"}
KINDS = ("sliding", "full")


def parse_attention_tiles(spec: str | None) -> dict[str, dict]:
    """An attention tiles spec -> {kind: {kernel key: value}} for the kinds of layer it names ("sliding", "full").
    The spec: parts joined by ';', each 'key=value,...' for every kind of layer or 'kind:key=value,...' for one,
    later parts over earlier ones; keys bm, bn, dv, warps, stages, split (positive integers). '' or None: the
    defaults (`tiles_for`). 'split=2' -> both kinds in two key runs; 'sliding:bm=32,split=2;full:dv=128'.
    ValueError naming the bad part."""
    out: dict[str, dict] = {k: {} for k in KINDS}
    for part in filter(None, (spec or "").replace(" ", "").split(";")):
        kind, _, body = part.rpartition(":")
        if kind and kind not in KINDS:
            raise ValueError(f"unknown kind of layer {kind!r} in attention tiles {part!r}; use {' or '.join(KINDS)}")
        for kv in body.split(","):
            k, _, v = kv.partition("=")
            if k not in TILE_KEYS or not v.isdigit() or int(v) < 1:
                raise ValueError(f"bad attention tile setting {kv!r} in {spec!r}: use {', '.join(TILE_KEYS)} = "
                                 "positive integers")
            for one in ([kind] if kind else KINDS):
                out[one][TILE_KEYS[k]] = int(v)
    return {k: t for k, t in out.items() if t}


def attention_tiles_spec(tiles: dict[str, dict]) -> str:
    """`parse_attention_tiles`' inverse, in one written form: 'sliding:bm=32,split=2;full:split=2' ('' for the
    defaults), keys in `TILE_KEYS` order."""
    names = {v: k for k, v in TILE_KEYS.items()}
    return ";".join(f"{kind}:" + ",".join(f"{names[k]}={tiles[kind][k]}" for k in TILE_KEYS.values()
                                          if k in tiles[kind]) for kind in KINDS if tiles.get(kind))


def with_split(spec: str | None, split: int | None) -> str:
    """`spec` (an attention tiles spec) with every kind of layer's key runs set to `split` (None: as it is), in
    `attention_tiles_spec`'s form."""
    tiles = parse_attention_tiles(spec)
    if split is not None:
        tiles = {kind: {**tiles.get(kind, {}), "SPLIT": split} for kind in KINDS}
    return attention_tiles_spec(tiles)


@functools.lru_cache(maxsize=64)
def kind_tiles(spec: str, window: int) -> tuple:
    """The (key, value) tile settings `spec` gives a layer with this window (0: a full layer), for
    `fixed_attention_triton`'s `tiles` (a tuple: cached per spec, read on every call of a pass)."""
    return tuple(sorted(parse_attention_tiles(spec).get("sliding" if window else "full", {}).items()))


def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Shapes the kernel takes: a power-of-two head dim of 16 or more (one dot over all of it), K = V head dims,
    whole groups of query heads."""
    D = q.shape[-1]
    return D >= 16 and D & (D - 1) == 0 and keys.shape[-1] == D and q.shape[1] % keys.shape[1] == 0


def fixed_attention_triton(q, keys, values, valid, start, S: int, window: int, ring: bool, tiles=None):
    """q [B, nh, M, D] (M = S + C rows at positions [start, start + M)), keys / values [B, kv, R, D] a layer's cache
    buffers holding this pass's K/V already, valid [B, P] bool, start a 0-dim int64 tensor on q's device, window W
    (0: a full layer), ring: position p in slot p % R -> [B, nh, M, D] (a transposed view of [B, M, nh, D], which
    the output projection's reshape takes without a copy). tiles: over `tiles_for`'s, a dict of its keys (BM, BN,
    DV, num_warps, num_stages) and SPLIT (default 1: each program runs over all of its rows' keys; k > 1: over a
    k-th of them, k times the programs, merged by a second kernel), or an attention tiles spec (a string,
    `parse_attention_tiles`: what the engine passes, `Options.attention_tiles`), of which this layer's kind's part."""
    if triton is None:
        raise RuntimeError("fixed_attention_triton needs triton (pip install triton)")
    if not supports(q, keys):
        raise ValueError(f"the attention kernel takes power-of-two head dims >= 16 and whole groups; got q "
                         f"{tuple(q.shape)}, keys {tuple(keys.shape)}")
    B, H, M, D = q.shape
    kv = keys.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(B, M, H, D, dtype=q.dtype, device=q.device)
    if isinstance(tiles, str):
        tiles = dict(kind_tiles(tiles, window))
    t = dict(tiles_for(D, q.element_size()), **(tiles or {}))
    bm, bn, dv, split = t.pop("BM"), t.pop("BN"), t.pop("DV", D), t.pop("SPLIT", 1)
    if D % dv or dv < 16:
        raise ValueError(f"the output column tile DV={dv} must divide the head dim {D} (and be >= 16)")
    if isinstance(split, bool) or not isinstance(split, int) or split < 1:
        raise ValueError(f"SPLIT (runs of the key tiles a row block is split into) must be a positive integer, "
                         f"got {split!r}")
    # split > 1: fp32 partial outputs and their log-sum-exps, merged by a second kernel
    part = torch.empty(split, B, M, H, D, dtype=torch.float32, device=q.device) if split > 1 else out
    lse = torch.empty(split, B, M, H, dtype=torch.float32, device=q.device) if split > 1 else out
    grid = (triton.cdiv((H // kv) * M, bm) * (D // dv), B * kv, split)
    _fixed_attention_kernel[grid](
        q, keys, values, valid.view(torch.uint8), start, out, part, lse,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1), out.stride(2),
        valid.stride(0), M, S, window, keys.shape[2],
        KV=kv, G=H // kv, D=D, DV=dv, BM=bm, BN=bn, SLIDING=window > 0, RING=bool(ring),
        F32=q.dtype == torch.float32 or interpreted(), SPLIT=split, **t)
    if split > 1:
        N, br = B * M * H, 16 if D <= 256 else 8
        _combine_kernel[(triton.cdiv(N, br),)](part, lse, out, N, D=D, BR=br, SPLIT=split)
    return out.transpose(1, 2)


def slot_positions(slots: int, end: torch.Tensor, ring: bool) -> torch.Tensor:
    """[slots] the position each slot of a layer holds once positions [0, end) were written (`end` on the device):
    slot s itself, or on a ring the last position p < end with p % slots == s (negative: none yet)."""
    s = torch.arange(slots, device=end.device)
    return s + torch.div(end - 1 - s, slots, rounding_mode="floor") * slots if ring else s


def fixed_attention_torch(q, keys, values, valid, start, S: int, window: int, ring: bool, tiles: str = ""):
    """`fixed_attention_triton` by the rules of model/keys.py: a mask over every slot of the layer (built on the
    device from `start`: fixed shapes, as a CUDA graph needs), through SDPA. The reference of the first-use check
    (`tiles`, the kernel's tiles spec, is taken and changes nothing here)."""
    M = q.shape[2]
    kpos = slot_positions(keys.shape[2], start + M, ring)
    seen = valid.index_select(1, kpos.clamp(min=0)) & (kpos >= 0)[None]
    rules = types.SimpleNamespace(window=window, bidirectional_encoder=False)
    sees = pass_sees(rules, SLIDING if window else FULL, start, S, M - S, kpos, seen)  # [B, M, slots]
    # a row that sees no key (a left-padding position, which no later row reads): 0, as the kernel writes (SDPA
    # averages every slot there), so the first-use check compares what matters
    blind = ~sees.any(-1)[:, None, :, None]  # (before additive_mask, which negates `sees` in place)
    B, H, M, D = q.shape
    out = q.new_empty(B, M, H, D).transpose(1, 2)  # the kernel's layout
    out.copy_(attention_sdpa_gqa(q, keys, values, additive_mask(sees[:, None], q.dtype)))
    return out.masked_fill_(blind, 0.0)


def fixed_attention_checked(q, keys, values, valid, start, S: int, window: int, ring: bool, tiles: str = ""):
    """`fixed_attention_triton`, compared with `fixed_attention_torch` on its first call per device, dtype and
    compiled variant (head dim, group, sliding, ring, with encoder rows, the layer's tiles), and replaced by it with a
    warning if it fails or disagrees: what the `attention_kernel` option runs on a CUDA GPU."""
    args = (q, keys, values, valid, start, S, window, ring)
    key = (str(q.device), str(q.dtype).removeprefix("torch."), "triton fixed attention",
           (q.shape[-1], q.shape[1] // keys.shape[1], window > 0, bool(ring), S > 0, kind_tiles(tiles, window)))
    return checked_on_first_use(key, lambda: fixed_attention_triton(*args, tiles=tiles),
                                lambda: fixed_attention_torch(*args),
                                "the Triton attention kernel")


FIXED_ATTENTION = {"torch": fixed_attention_torch, "triton": fixed_attention_triton,
                   "triton_checked": fixed_attention_checked}


@torch.library.custom_op("blockpress::fixed_attention", mutates_args=())
def fixed_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                       start: torch.Tensor, S: int, window: int, ring: bool, kernel: str,
                       tiles: str = "") -> torch.Tensor:
    """`FIXED_ATTENTION[kernel]` as one opaque call in a compiled graph (tiles: an attention tiles spec)."""
    return FIXED_ATTENTION[kernel](q, keys, values, valid, start, S, window, ring, tiles=tiles)


@fixed_attention_op.register_fake
def _(q, keys, values, valid, start, S, window, ring, kernel, tiles=""):
    B, H, M, D = q.shape
    return q.new_empty(B, M, H, D).transpose(1, 2)
