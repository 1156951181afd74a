"""Time the Triton kernels' settings on this GPU for a model's shapes, and keep the fastest (`blockpress tune`).

Shape legend: N tokens (batch x canvas), E experts, K top-k, H hidden, Im the experts' intermediate width.

Three choices are tuned, each among variants of one function (the same numbers up to fp32 summation order), so the
choice changes speed only:
- the expert kernels' tiles (`moe_tiles`): one layer's experts with random weights of the model's shapes and format,
  a canvas's tokens routed top-K by a random router, every setting of a grid timed; the built-in default first,
  checked against the plain-torch experts, every other setting against it;
- the 8-bit projections' tiles (`linear_tiles`, kernels/linear_q.py): every projection shape of a pass (q/k/v and
  gate/up merged, as they run), each candidate timed over the whole pass, checked against the kernel's reference;
- the attention kernel's tiles and key runs per row block, per kind of layer (`attention_tiles`,
  kernels/attention_fixed.py): a denoising pass's attention after `context` cached tokens, each candidate timed on
  one layer of a kind times its number of layers, checked against the defaults' output and that against the torch
  reference.
A setting that does not compile or disagrees is reported and never kept. The winner goes to the tuned-settings
file (kernels/tuned.py), which `load` reads when no setting is asked for.

Timing: `profile.time_ms` (CUDA: triton's do_bench, median after warm-up; a CPU runs Triton's interpreter, whose
times say nothing about a GPU: tests only).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from .profile import time_ms

# 18 settings (+ the defaults, which are among them), then the M tile alone at the default N and K tiles (bm=auto
# sizes it for the spread of the routing, from compile_report.py's issue model), then the weight as the MMA's
# register operand (swap). BK 32 and BN 64 stay in: the defaults moved to BK 64 and BN 128 on compile_report.py's
# static model; BN 256 reads the activations from L2 half as often again for as many instructions, but needs 255
# registers from bm 64 on
DEFAULT_GRID = "bm=auto;bn=64,128,256;bk=32,64,128;warps=4,8|bm=16,32,64|bm=auto,16,32;bn=64,128;bk=64,128;swap=1"
QUICK_GRID = "bm=auto;bn=64,128;bk=64,128|bm=auto,16;bn=64,128;bk=128;swap=1"  # 8 settings
# the attention kernel's candidates by head dim (attention tiles specs, kernels/attention_fixed.py), its defaults
# ('': `tiles_for`) first; other head dims: the defaults in 1-4 key runs. Those that compile for sm_90 without
# spilling (benchmarks/compile_report.py --attention-tiles tune). D 256, the 26B model's sliding layers (64 programs at
# batch 1 with the defaults' 64-row blocks, for 132 SMs): the keys in runs, 32-key tiles with three stages on 4 warps
# (wgmma), 32-row blocks on 4 warps (mma.sync; in one run they spill). D 512, its full layers: runs, DV 128 (four
# programs a row block, each with all of Q K^T), 32-row blocks (mma.sync), 16-key tiles with three stages in one run
SPLITS = ("", "split=2", "split=3", "split=4")
ATTENTION_TILES = {
    256: [*SPLITS, "bn=32,warps=4,stages=3", "bn=32,warps=4,stages=3,split=2", "bn=32,warps=4,stages=3,split=4",
          "bm=32,warps=4,split=2", "bm=32,warps=4,split=4", "bm=32,warps=4,stages=3,split=2"],
    512: [*SPLITS, "dv=128", "dv=128,split=2", "dv=128,split=4", "bm=32,warps=4", "bm=32,warps=4,split=2",
          "bn=16,stages=3"]}
# `--quick`: 5 a head dim (each a compile of its own, ~seconds on a GPU): the defaults, in 2 runs, and one of each
# other kind of tile
ATTENTION_QUICK = {256: ["", "split=2", "split=4", "bn=32,warps=4,stages=3,split=2", "bm=32,warps=4,split=2"],
                   512: ["", "split=2", "dv=128", "dv=128,split=2", "bm=32,warps=4"]}
# the 8-bit projections' candidates by format (`linear_tiles` specs), the default first. Weight-only: on an H200
# (2026-11-25) the default tiles ran 2.2x slower than cuBLAS bf16 at 256 rows and 2x at one row although they move
# half the bytes (a 2112-wide projection has 33 N tiles of 64, a quarter of the 132 SMs at one row); narrower N tiles
# and K split over several programs (fp32 atomic adds) give the GPU more programs; bm=128 and wider tiles with 8
# warps (fewer programs) were slower there; swap=1: the weight as the MMA's register operand (wgmma on sm_90), a
# canvas's rows in one block. fp8 x fp8 ("fp8-a8", `--fp8-activations`): the default tiles, a K tile of 128 and a
# 128-row block (compiled for sm_90 at a canvas: 0.39, 0.26 and 0.21 K-loop instructions per weight)
WEIGHT_ONLY_SPECS = ["bm=auto,bn=64,bk=64", "bm=auto,bn=32,bk=64", "bm=auto,bn=64,bk=64,split=2",
                     "bm=auto,bn=64,bk=64,split=4", "bm=auto,bn=64,bk=64,split=8", "bm=auto,bn=32,bk=64,split=4",
                     "bm=auto,bn=32,bk=128,split=4", "bm=128,bn=64,bk=64", "bm=auto,bn=64,bk=64,swap=1",
                     "bm=auto,bn=128,bk=64,swap=1"]
LINEAR_SPECS = {"int8": WEIGHT_ONLY_SPECS, "fp8": WEIGHT_ONLY_SPECS,
                "fp8-a8": ["bm=auto,bn=64,bk=64", "bm=auto,bn=64,bk=128", "bm=128,bn=64,bk=128"]}


def parse_grid(text: str) -> list[str]:
    """'bm=16,32;bn=64' -> ['bm=16,bn=64', 'bm=32,bn=64'] (every combination, each checked by parse_tiles); grids
    joined by '|' are taken one after the other ('bm=auto;bn=64,128|bm=16,32': four settings). ValueError naming
    the bad part."""
    from ..kernels.moe_grouped import parse_tiles

    specs = []
    for grid in text.split("|"):
        axes = []
        for part in filter(None, (p.strip() for p in grid.split(";"))):
            key, _, vals = part.partition("=")
            if not vals:
                raise ValueError(f"bad grid part {part!r}: use key=v1,v2 parts separated by ';'")
            axes.append([f"{key.strip()}={v.strip()}" for v in vals.split(",") if v.strip()])
        specs += [s for s in (",".join(combo) for combo in itertools.product(*axes)) if s not in specs]
    specs = specs or [""]
    for spec in specs:
        parse_tiles(spec)
    return specs


def build_layer(text, precision: str, device, dtype, group_size: int, seed: int, mlp: bool = False):
    """One layer's experts: (call(x, w, idx, tiles) -> [N, H], reference(x, w, idx) -> [N, H] in plain torch,
    expert bytes of the whole layer). precision: "native", "fp8", "int4" or "fp8-a8" (fp8 weights and
    activations). mlp: the layer's dense MLP instead, as the one expert every token takes (`--linears int4-mlp`,
    kernels/quant.py QuantizedMLP)."""
    from ..kernels.moe_grouped import FMT_FP8, FMT_INT4, experts_triton
    from ..kernels.quant import QuantizedExperts, expert_format, experts_w8a8_torch
    from ..model.moe import experts_loop

    E, H, Im = (1, text.hidden_size, text.intermediate_size) if mlp else \
        (text.num_experts, text.hidden_size, text.moe_intermediate_size)
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(E, 2 * Im, H, generator=g, device=device) * 0.02).to(dtype)
    down = (torch.randn(E, H, Im, generator=g, device=device) * 0.02).to(dtype)
    if precision == "native":
        nbytes = (gate_up.numel() + down.numel()) * gate_up.element_size()

        def call(x, w, idx, tiles):
            return experts_triton(x, w, idx, gate_up, down, tiles=tiles)
        return call, (lambda x, w, idx: experts_loop(x, w, idx, gate_up, down)), nbytes
    weights, a8 = expert_format(precision)  # fp8-a8: fp8 activations too (w8a8)
    q = QuantizedExperts(E, H, Im, weights, group_size, dtype=dtype, device=device).load_float_(gate_up, down)
    del gate_up, down
    fmt = FMT_FP8 if weights == "fp8" else FMT_INT4

    def call(x, w, idx, tiles):
        return experts_triton(x, w, idx, q.gate_up_q, q.down_q, fmt=fmt, gate_up_scale=q.gate_up_scale,
                              down_scale=q.down_scale, groups=q.groups, inter=q.inter, tiles=tiles, act8=a8)
    if a8:
        return call, (lambda x, w, idx: experts_w8a8_torch(x, w, idx, *q._weights())), q.weight_bytes()
    return call, q._forward_torch, q.weight_bytes()  # the torch path dequantises each busy expert


def routed_tokens(text, tokens: int, device, dtype, seed: int, mlp: bool = False):
    """(x [N, H], w [N, K], idx [N, K]): `tokens` random activations routed top-K by a random router (mlp: every
    token to the one expert, weight 1, as QuantizedMLP routes)."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, text.hidden_size, generator=g, device=device).to(dtype)
    if mlp:
        return x, torch.ones(tokens, 1, device=device), torch.zeros(tokens, 1, dtype=torch.int64, device=device)
    probs = torch.softmax(torch.randn(tokens, text.num_experts, generator=g, device=device), dim=-1)
    w, idx = torch.topk(probs, text.top_k_experts, dim=-1)
    return x, w / w.sum(-1, keepdim=True), idx


def tolerance(dtype: torch.dtype) -> float:
    """Largest relative max error between two settings' outputs that counts as agreeing (fp32 reassociation; in
    16 bits, the output's rounding)."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _failure(e: Exception) -> str:
    """A candidate that did not run, as its row says it: the error's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def sweep_tiles(call, reference, x, w, idx, specs: list[str], device, repeats: int = 3,
                report: Callable[[dict, int, int], None] | None = None, floor_bytes: float | None = None,
                bandwidth: float | None = None) -> tuple[list[dict], float]:
    """Time `call` (an expert layer, `build_layer`) at every tile spec. The first is the reference point: it is
    checked against the plain-torch `reference`, every other spec against it. Returns (rows, the first's relative
    error against torch); a row: spec, and ms and rel_err_vs_first and ok (within `tolerance`), or failed (why it
    did not run); with `floor_bytes` (the expert bytes a call must read) also gbs, and with the device's copy
    `bandwidth` (bytes/s) floor_fraction, the share of it. report(row, i, n) after each."""
    from ..kernels.moe_grouped import parse_tiles

    tol = tolerance(x.dtype)
    want = reference(x, w, idx).float()
    first, vs_torch, rows = None, float("nan"), []
    for i, spec in enumerate(specs, 1):
        tiles = parse_tiles(spec)
        row = {"spec": tiles.spec()}
        try:
            out = call(x, w, idx, tiles)
            if first is None:
                first, vs_torch = out.float(), _rel(out, want)
            err = _rel(out, first)
            ms = time_ms(lambda: call(x, w, idx, tiles), device, repeats)
            row.update(ms=ms, rel_err_vs_first=err, ok=err < tol and vs_torch < tol)
            if floor_bytes:
                row["gbs"] = floor_bytes / (ms / 1e3) / 1e9
                if bandwidth:
                    row["floor_fraction"] = floor_bytes / bandwidth / (ms / 1e3)
        except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result, not a crash
            row["failed"] = _failure(e)
        rows.append(row)
        if report is not None:
            report(row, i, len(specs))
    return rows, vs_torch


def fastest(rows: list[dict]):
    """The row that agreed and ran fastest, or None."""
    timed = [r for r in rows if r.get("ok")]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def tune_experts(text, canvas: int, fmt: str, device, dtype, group_size: int = 64, batch: int = 1,
                 grid: str = DEFAULT_GRID, repeats: int = 3, seed: int = 0, mlp: bool = False, report=None,
                 bandwidth: float | None = None) -> dict:
    """The expert kernels' tiles for `fmt` ("native", "fp8", "fp8-a8", "int4") at `batch` canvases of `canvas`
    tokens (mlp: the dense MLP on the experts' int4 kernels): the default for this device first
    (`moe_grouped.default_tiles`), then `grid`. -> {"default", "best" (spec or None when no setting ran and
    agreed), "rows", "rel_err_vs_torch", "tokens"}; each row's gbs is the layer's expert bytes the tokens hit
    (`roofline.expected_hit_fraction`) over its time, and with the copy `bandwidth` its floor_fraction."""
    from ..kernels.moe_grouped import _wgmma_target, default_tiles, parse_tiles
    from ..kernels.quant import expert_format
    from .roofline import expected_hit_fraction

    default = default_tiles("int4" if mlp else expert_format(fmt)[0], _wgmma_target(device)).spec()
    specs = [default] + [s for s in parse_grid(grid) if parse_tiles(s).spec() != default]
    tokens = batch * canvas
    x, w, idx = routed_tokens(text, tokens, device, dtype, seed, mlp)
    call, reference, layer_bytes = build_layer(text, fmt, device, dtype, group_size, seed, mlp)
    hit = 1.0 if mlp else expected_hit_fraction(text.num_experts, text.top_k_experts, tokens)
    rows, vs_torch = sweep_tiles(call, reference, x, w, idx, specs, device, repeats, report, layer_bytes * hit,
                                 bandwidth)
    best = fastest(rows)
    return {"default": default, "best": None if best is None else best["spec"], "rows": rows,
            "rel_err_vs_torch": vs_torch, "tokens": tokens}


def projection_shapes(text, fused: bool = False) -> dict[tuple[int, int], int]:
    """(in, out) -> how many projections of one pass have that shape (all layers). fused: q, k and v as one
    projection, and gate and up as one (`merge_projections`, the default: fewer, wider GEMMs)."""
    shapes: dict[tuple[int, int], int] = {}
    H = text.hidden_size
    for i in range(text.num_hidden_layers):
        heads, kv, D = text.num_attention_heads, text.layer_kv_heads(i), text.layer_head_dim(i)
        qkv = [heads * D, kv * D] + ([] if text.is_full(i) else [kv * D])  # q, k, v (full layers: k = v)
        layer = ([(H, sum(qkv))] if fused else [(H, o) for o in qkv]) + [(heads * D, H)]  # ..., o
        inter = text.intermediate_size
        layer += ([(H, 2 * inter)] if fused else [(H, inter)] * 2) + [(inter, H)]  # gate, up, down
        for s in layer:
            shapes[s] = shapes.get(s, 0) + 1
    return shapes


def tune_linears(text, canvas: int, fmt: str, device, dtype, batch: int = 1, specs=None, repeats: int = 3,
                 seed: int = 0, report=None) -> dict:
    """The 8-bit projections' tiles for `fmt` ("int8", "fp8", or "fp8-a8": fp8 weights and activations) at `batch`
    canvases: each spec (default `LINEAR_SPECS[fmt]`, the built-in default first) timed over one pass's projection
    shapes (merged, each time its count), every shape checked against the kernel's reference. -> {"default",
    "best", "rows", "rel_err_vs_torch"} (a row: spec, ms per pass, rel_err_vs_first, ok / failed)."""
    from ..kernels.linear_q import (DEFAULT_LINEAR_SPEC, QuantizedLinear, linear_fp8_w8a8_reference,
                                    linear_q_triton, parse_linear_tiles)

    a8 = fmt == "fp8-a8"
    specs = list(specs or LINEAR_SPECS[fmt])
    specs = [DEFAULT_LINEAR_SPEC] + [sp for sp in specs if sp != DEFAULT_LINEAR_SPEC]
    g = torch.Generator(device=device).manual_seed(seed)
    M, tol = batch * canvas, tolerance(dtype)
    cases = []  # (x, q, reference output, count)
    for (I, O), count in sorted(projection_shapes(text, fused=True).items()):
        lin = torch.nn.Linear(I, O, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(O, I, generator=g, device=device) / I ** 0.5)
        q = QuantizedLinear.from_linear(lin, "fp8" if a8 else fmt, backend="torch")
        x = torch.randn(M, I, generator=g, device=device).to(dtype)
        with torch.no_grad():
            want = linear_fp8_w8a8_reference(x, q.weight_q, q.weight_scale) if a8 else q(x)
        cases.append((x, q, want.float(), count))
    rows, vs_torch, first = [], 0.0, None
    for i, spec in enumerate(specs, 1):
        row, t = {"spec": spec}, parse_linear_tiles(spec)
        try:
            outs = [linear_q_triton(x, q.weight_q, q.weight_scale, **t, act8=a8) for x, q, _, _ in cases]
            if first is None:
                first = [o.float() for o in outs]
                vs_torch = max(_rel(o, w) for o, (_, _, w, _) in zip(first, cases))
            err = max(_rel(o, f) for o, f in zip(outs, first))
            ms = sum(n * time_ms(lambda x=x, q=q: linear_q_triton(x, q.weight_q, q.weight_scale, **t, act8=a8),
                                 device, repeats) for x, q, _, n in cases)
            row.update(ms=ms, rel_err_vs_first=err, ok=err < tol and vs_torch < tol)
        except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result
            row["failed"] = _failure(e)
        rows.append(row)
        if report is not None:
            report(row, i, len(specs))
    best = fastest(rows)
    return {"default": DEFAULT_LINEAR_SPEC, "best": None if best is None else best["spec"], "rows": rows,
            "rel_err_vs_torch": vs_torch, "tokens": M}


def attention_candidates(D: int, quick: bool = False) -> list[str]:
    """The attention kernel's candidates (attention tiles specs) for a kind of layer of head dim D, the defaults ('')
    first: `ATTENTION_TILES` (quick: `ATTENTION_QUICK`), else the defaults in 1 to 4 key runs."""
    return list((ATTENTION_QUICK if quick else ATTENTION_TILES).get(D, SPLITS))


def tune_attention(text, canvas: int, device, dtype, batch: int = 1, context: int = 2048, repeats: int = 3,
                   seed: int = 0, report=None, candidates=attention_candidates) -> dict:
    """The attention kernel's tiles per kind of layer for a denoising pass of `batch` canvases after `context`
    cached tokens: each candidate (`candidates(D)`: attention tiles specs for both kinds, the defaults '' first)
    timed on that kind's layer, times its number of layers, checked against the defaults' output (which is checked
    against the torch reference). Kinds are tuned apart: the best is each kind's fastest that agreed, as one
    attention tiles spec. -> {"default": '', "best" (None where a kind has none), "rows" (kind, spec, ms per pass,
    rel_err_vs_first, ok / failed), "rel_err_vs_torch", "default_ms", "best_ms", "context"}."""
    from ..config import FULL, SLIDING
    from ..kernels.attention_fixed import (attention_tiles_spec, fixed_attention_torch, fixed_attention_triton,
                                           parse_attention_tiles)
    from ..model.cache import KVCache

    kinds = [t for t in (SLIDING, FULL) if t in text.layer_types]
    first = {t: text.layer_types.index(t) for t in kinds}
    shapes = [(text.layer_kv_heads(first[t]), text.layer_head_dim(first[t])) for t in kinds]
    cache = KVCache(shapes, batch, context + 2 * canvas, dtype, device, sliding=[t == SLIDING for t in kinds],
                    window=text.sliding_window, reserve=max(2048, 2 * canvas))
    g = torch.Generator(device=device).manual_seed(seed)
    for buf in cache.keys + cache.values:
        buf.copy_(torch.randn(buf.shape, generator=g, device=device, dtype=torch.float32))
    start = torch.tensor(context, device=device)
    H, tol = text.num_attention_heads, tolerance(dtype)
    todo = []
    for i, t in enumerate(kinds):
        D = shapes[i][1]
        q = torch.randn(batch, H, canvas, D, generator=g, device=device, dtype=torch.float32).to(dtype) / D ** 0.25
        a = (q, cache.keys[i], cache.values[i], cache.valid, start, 0, text.sliding_window if t == SLIDING else 0,
             t == SLIDING and cache.ring is not None)  # the arguments model/keys.py `Fixed` passes
        todo += [(t.split("_")[0], a, text.layer_types.count(t), spec) for spec in candidates(D)]
    rows, ref, vs_torch = [], {}, {}  # per kind: the output at the defaults (the others' reference point), and its
    # error against torch
    for j, (kind, a, n, spec) in enumerate(todo, 1):
        row = {"kind": kind, "spec": spec}
        try:  # (the kernel takes the spec's part for this kind of layer)
            out = fixed_attention_triton(*a, tiles=spec).float()
            if kind not in ref:
                ref[kind], vs_torch[kind] = out, _rel(out, fixed_attention_torch(*a))
            err = _rel(out, ref[kind])
            ms = n * time_ms(lambda: fixed_attention_triton(*a, tiles=spec), device, repeats)
            row.update(ms=ms, rel_err_vs_first=err, ok=err < tol and vs_torch[kind] < tol)
        except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result
            row["failed"] = _failure(e)
        rows.append(row)
        if report is not None:
            report(row, j, len(todo))
    wins = {kind: fastest([r for r in rows if r["kind"] == kind]) for kind, *_ in todo}
    default = {kind: next((r for r in rows if r["kind"] == kind and r["spec"] == "" and r.get("ok")), None)
               for kind in wins}
    best = None if None in wins.values() else attention_tiles_spec(
        {kind: parse_attention_tiles(r["spec"]).get(kind, {}) for kind, r in wins.items()})
    return {"default": "", "best": best, "rows": rows, "rel_err_vs_torch": max(vs_torch.values(), default=0.0),
            "context": context,
            "best_ms": None if best is None else sum(r["ms"] for r in wins.values()),
            "default_ms": None if None in default.values() else sum(r["ms"] for r in default.values())}
