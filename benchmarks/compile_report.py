"""Compile every Triton kernel of blockpress for a CUDA GPU, on a machine without one, and report what came out.

The CPU agreement tests run the kernels in Triton's interpreter, which never builds GPU code (and takes
fp32 dots where a GPU takes bf16 / fp8 tensor-core ones). This script compiles the variants a GPU run of a
config would compile (`blockpress.lab.aot`: the launchers run unchanged on CPU tensors of the real
shapes, Triton compiles for `--arch` with its own ptxas and launches nothing), then prints, per variant:
registers, spills, shared memory, resident blocks per SM, the widths of its global loads, which MMA its dots
became, its instruction count and that of its largest loop (a matmul kernel's K-tile iteration: the number to
watch for dequantisation work); and whether it would launch (shared memory and registers within the
architecture's limits). Exits 1 if a variant fails to compile or would not launch. fp8 variants are skipped
before sm_89 (Triton has no e4m3 there; the engine runs fp8 weights through torch on those cards).

    python benchmarks/compile_report.py                                   # real-26b, sm_90 (H100/H200)
    python benchmarks/compile_report.py --arch 90,89,86 --grid "bm=auto;bn=64,128;bk=32,64,128;warps=4,8"

Per architecture it ends with an issue model of a denoising step's expert kernels: instructions per weight
(the compiled K-tile loop over the weights it covers) x the step's weights / the card's issue rate, against
the experts' bytes / its bandwidth: which side bounds them (`--tiles` to try other default tiles).

What it cannot tell: time. It is the static half of a GPU measurement (benchmarks/gpu_session.sh is the
other). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # before any triton.jit: compiled kernels, not interpreted ones
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what a GPU run gets today (Triton 3.9 warns if unset)

import torch  # noqa: E402


def canvas_batches(batches: list[int], canvas: int, prefill_chunk: int) -> list[tuple[str, int]]:
    """(what, tokens) of the passes a generation runs: canvases of each batch size, a prefill chunk, an AR token."""
    return [(f"canvas x{b}", b * canvas) for b in batches] + [(f"prefill {prefill_chunk}", prefill_chunk),
                                                             ("AR token", 1)]


def expert_variants(text, dtype, passes, tiles: list[str], precisions: list[str], base=None, arch: int = 90):
    """(label, thunk) per expert kernel launch: every precision x pass x tile setting (+ the atomic K-sum); the
    setting "" is `base` (default: the engine's defaults for that precision on `arch`, `moe_grouped.default_tiles`)."""
    from blockpress.kernels import moe_grouped as mg
    from blockpress.kernels.quant import QuantizedExperts, expert_format

    E, H, Im, K = text.num_experts, text.hidden_size, text.moe_intermediate_size, text.top_k_experts
    for precision in precisions:
        weights, a8 = expert_format(precision)  # fp8-a8: fp8 weights with fp8 activations (experts="w8a8")
        if precision == "native":
            gate_up, down = torch.empty(E, 2 * Im, H, dtype=dtype), torch.empty(E, H, Im, dtype=dtype)
            kw = {}
        else:
            q = QuantizedExperts(E, H, Im, weights, dtype=dtype)
            gate_up, down = q.gate_up_q, q.down_q
            kw = dict(fmt=mg.FMT_FP8 if weights == "fp8" else mg.FMT_INT4, gate_up_scale=q.gate_up_scale,
                      down_scale=q.down_scale, groups=q.groups, inter=Im, act8=a8)
        for what, N in passes:
            g = torch.Generator().manual_seed(N)
            idx = torch.rand(N, E, generator=g).topk(K, dim=-1).indices
            x, w = torch.empty(N, H, dtype=dtype), torch.full((N, K), 1.0 / K)
            for spec in tiles:
                for moe_sum in ("kernel", "atomic") if spec == tiles[0] else ("kernel",):
                    t = mg.as_tiles(spec) if spec else (base or mg.default_tiles(weights, arch >= 90))

                    def run(t=t, moe_sum=moe_sum, x=x, w=w, idx=idx, gate_up=gate_up, down=down, kw=kw):
                        mg.experts_triton(x, w, idx, gate_up, down, tiles=t, moe_sum=moe_sum, **kw)
                    label = f"experts {precision}, {what}, tiles {t.spec()}" + \
                        (", atomic sum" if moe_sum == "atomic" else "")
                    yield label, run


def linear_variants(text, dtype, passes, formats: list[str]):
    """(label, thunk) per 8-bit projection launch: every format x distinct weight shape x pass."""
    from bench_linears import projection_shapes

    from blockpress.kernels.linear_q import linear_q_triton
    from blockpress.kernels.quant import FP8

    for fmt in formats:
        a8 = fmt == "fp8-a8"  # fp8 weights with fp8 activations (experts="w8a8"): the row quantiser, then the kernel
        for I, O in sorted(projection_shapes(text)):
            q = torch.empty(O, I, dtype=torch.int8 if fmt == "int8" else FP8)
            s = torch.empty(O, dtype=torch.float32)
            for what, M in passes:
                x = torch.empty(M, I, dtype=dtype)
                yield (f"linear {fmt} [{O}x{I}], {what}",
                       lambda x=x, q=q, s=s, a8=a8: linear_q_triton(x, q, s, act8=a8))
                if fmt == "int8" and what.startswith("canvas"):  # bench_linears.py's int8-bm128 / -bm256
                    for bm in (128, 256):
                        yield (f"linear {fmt} [{O}x{I}], {what}, bm {bm}",
                               lambda x=x, q=q, s=s, bm=bm: linear_q_triton(x, q, s, block_m=bm))
                # the weight as wgmma's register operand, a canvas in one block (not with fp8 activations: they
                # convert no weight, and 256 rows' fp32 accumulators spill)
                if what.startswith("canvas") and not a8:
                    yield (f"linear {fmt} [{O}x{I}], {what}, swap",
                           lambda x=x, q=q, s=s, a8=a8: linear_q_triton(x, q, s, swap=True, act8=a8))


def attention_variants(text, dtype, canvas: int, batches: list[int], specs: list[str] = ()):
    """(label, thunk) per launch of the fixed-shape passes' attention kernel (kernels/attention_fixed.py): each kind
    of layer (a sliding one on its ring) for a canvas of each batch size after 2,048 cached tokens, and a fused
    commit + canvas; at batch 1 also at each attention tiles spec of `specs` (split=k: SPLIT and the merging
    kernel; `blockpress tune`'s candidates: blockpress.lab.tune.attention_candidates)."""
    from blockpress.config import FULL, SLIDING
    from blockpress.kernels.attention_fixed import fixed_attention_triton

    H = text.num_attention_heads
    for t in (SLIDING, FULL):
        i = text.layer_types.index(t) if t in text.layer_types else None
        if i is None:
            continue
        kv, D = text.layer_kv_heads(i), text.layer_head_dim(i)
        W = text.sliding_window if t == SLIDING else 0
        for what, B, S in [(f"canvas x{b}", b, 0) for b in batches] + [("fused commit + canvas x1", 1, canvas)]:
            P = 2048 + S + canvas
            R = W + max(2048, S + canvas) if W else P  # a ring, as the engine's caches keep one
            q = torch.empty(B, H, S + canvas, D, dtype=dtype)
            keys, values = (torch.empty(B, kv, R, D, dtype=dtype) for _ in range(2))
            valid, start = torch.ones(B, P, dtype=torch.bool), torch.tensor(2048)
            yield (f"attention {t.split('_')[0]} D {D} G {H // kv}, {what}",
                   lambda q=q, k=keys, v=values, valid=valid, start=start, S=S, W=W:
                   fixed_attention_triton(q, k, v, valid, start, S, W, bool(W)))
            for spec in specs if what == "canvas x1" else ():  # other tiles, or the keys in runs and their merge
                yield (f"attention {t.split('_')[0]} D {D} G {H // kv}, {what}, {spec}",
                       lambda q=q, k=keys, v=values, valid=valid, start=start, S=S, W=W, spec=spec:
                       fixed_attention_triton(q, k, v, valid, start, S, W, bool(W), tiles=spec))


def attention_specs(arg: str, text) -> list[str]:
    """--attention-tiles: '|'-separated attention tiles specs, checked; 'tune': `blockpress tune`'s candidates for
    this model's head dims (the defaults left out: they are compiled anyway)."""
    from blockpress.kernels.attention_fixed import parse_attention_tiles
    from blockpress.lab.tune import attention_candidates

    if arg.strip() == "tune":
        dims = {}  # kind of layer -> its head dim
        for i, t in enumerate(text.layer_types):
            dims.setdefault(t.split("_")[0], text.layer_head_dim(i))
        return [f"{kind}:{spec}" for kind, D in dims.items() for spec in attention_candidates(D) if spec]
    specs = [s.strip() for s in arg.split("|") if s.strip()]
    try:
        for spec in specs:
            parse_attention_tiles(spec)
    except ValueError as e:
        raise SystemExit(f"--attention-tiles: {e}") from None
    return specs


def head_variants(vocab: int, canvas: int, dtype, batches: list[int], cap: float | None):
    """(label, thunk) for the soft cap and the fused sampler over each batch's [B, C, V] logits: the engine's fast
    sampler reads the LM head's product (`dtype`) and applies the soft cap itself; the exact sampler's logits go
    through the soft-cap kernel."""
    from blockpress.kernels.sampler_fused import fused_sample_triton
    from blockpress.kernels.softcap import softcap_triton

    seed = torch.zeros(1, dtype=torch.int64)
    for b in batches:
        if cap:
            yield f"soft cap, canvas x{b}", (lambda b=b: softcap_triton(torch.empty(b, canvas, vocab, dtype=dtype),
                                                                        cap))
            product = torch.empty(b, canvas, vocab, dtype=dtype)
            yield (f"fused sampler + soft cap, canvas x{b}",
                   lambda x=product: fused_sample_triton(x, torch.tensor(0.7), seed, out_dtype=dtype, cap=cap))
        raw = torch.empty(b, canvas, vocab, dtype=torch.float32)
        for tau in (torch.tensor(0.7), None):
            yield (f"fused sampler, canvas x{b}" + ("" if tau is not None else ", no temperature"),
                   lambda raw=raw, tau=tau: fused_sample_triton(raw, tau, seed, out_dtype=dtype))


def main(argv=None) -> int:
    from blockpress.lab.bench import DTYPES
    from blockpress.lab.presets import preset_config
    from blockpress.config import ModelConfig
    from blockpress.kernels._triton import triton
    from blockpress.lab.aot import ARCHS, compile_only, read_back
    from blockpress.model.diffusion_gemma import PREFILL_CHUNK

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="real-26b", choices=["tiny", "small", "real-26b"])
    p.add_argument("--config", help="a config.json (diffusion_gemma) instead of a preset")
    p.add_argument("--arch", default="90", help=f"comma-separated compute capabilities ({', '.join(map(str, ARCHS))})")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="activation dtype (the GPU runs bf16)")
    p.add_argument("--batch", default="1,2,4,8", help="canvas batch sizes")
    p.add_argument("--precision", default="native,fp8,int4,fp8-a8",
                   help="expert formats (fp8-a8: fp8 weights and activations, experts='w8a8')")
    p.add_argument("--linears", default="int8,fp8,fp8-a8",
                   help="8-bit projection formats ('' for none; fp8-a8: fp8 weights and activations)")
    p.add_argument("--grid", default="", help="extra MoE tile settings, e.g. 'bm=auto,32;bn=64,128' "
                                              "(benchmarks/sweep_moe_tiles.py's grid syntax)")
    p.add_argument("--tiles", default=None, help="the MoE tiles to take as the defaults (a moe_tiles spec, e.g. "
                                                 "'bk=64'; the issue model reads these)")
    p.add_argument("--attention-tiles", default="",
                   help="also compile the attention kernel at these tiles at batch 1, '|' between specs (e.g. "
                        "'split=2|sliding:bm=32,warps=4'); 'tune': blockpress tune's candidates")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args(argv)
    from blockpress.kernels.moe_grouped import as_tiles
    try:
        base = as_tiles(args.tiles) if args.tiles else None  # None: the engine's defaults per precision
    except ValueError as e:
        raise SystemExit(f"--tiles: {e}") from None

    if triton is None:
        raise SystemExit("compile_report needs triton (pip install triton): nothing to compile without it")
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"--arch and --batch take comma-separated integers, got {args.arch!r}, {args.batch!r}")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown or not archs or not batches or min(batches) < 1:
        raise SystemExit(f"--arch takes {sorted(ARCHS)} (got {args.arch!r}); --batch positive integers")
    precisions = [x for x in args.precision.split(",") if x]
    linears = [x for x in args.linears.split(",") if x]
    if set(precisions) - {"native", "fp8", "int4", "fp8-a8"} or set(linears) - {"int8", "fp8", "fp8-a8"}:
        raise SystemExit("--precision takes native, fp8, int4, fp8-a8; --linears takes int8, fp8, fp8-a8")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sweep_moe_tiles, bench_linears
    from sweep_moe_tiles import parse_grid

    dtype = DTYPES[args.dtype]
    config = json.load(open(args.config)) if args.config else preset_config(args.preset)[0]
    cfg = ModelConfig.from_dict(config)
    text, C = cfg.text, cfg.canvas_length
    passes = canvas_batches(batches, C, PREFILL_CHUNK)
    tiles = [""] + (parse_grid(args.grid) if args.grid else [])
    rest = list(linear_variants(text, dtype, passes, linears)) + \
        list(head_variants(text.vocab_size, C, dtype, batches, text.final_logit_softcapping)) + \
        list(attention_variants(text, dtype, C, batches, attention_specs(args.attention_tiles, text)))
    todo = {arch: list(expert_variants(text, dtype, passes, tiles, precisions, base, arch)) + rest for arch in archs}
    print(f"compile_report: triton {triton.__version__}, torch {torch.__version__}, {args.config or args.preset}, "
          f"{args.dtype} activations, {len(todo[archs[0]])} launches x sm_{', sm_'.join(map(str, archs))}", flush=True)

    result = {"bench": "compile_report", "triton": triton.__version__, "torch": torch.__version__,
              "config": args.config or args.preset, "dtype": args.dtype, "archs": {}}
    failed = 0
    for arch in archs:
        t0 = time.perf_counter()
        seen: dict = {}  # one row per distinct compiled kernel (Triton's hash), the launches that share it listed
        here = todo[arch]
        if arch < 89:  # Triton has no e4m3 before Ada; the engine takes torch for fp8 there (fp8_usable_on)
            here = [(label, run) for label, run in todo[arch] if "fp8" not in label]
            print(f"  sm_{arch}: {len(todo[arch]) - len(here)} fp8 launches skipped (no float8_e4m3fn in Triton before "
                  "sm_89; fp8 weights run the torch paths there)")
        with compile_only(arch) as got:
            for i, (label, run) in enumerate(here, 1):
                n = len(got)
                run()
                for name, kernel in got[n:]:
                    key = getattr(kernel, "hash", None) or f"{name} {label}"
                    if key in seen:
                        seen[key]["also"] += 1
                        seen[key]["also_for"].append(label)
                        continue
                    seen[key] = dict(read_back(name, kernel, label, arch).row(), also=0, also_for=[])
                if i % 20 == 0 or i == len(here):
                    print(f"  sm_{arch}: {i}/{len(here)} launches, {len(seen)} kernels, "
                          f"{time.perf_counter() - t0:.0f} s", flush=True)
        rows = list(seen.values())
        print_table(rows, arch)
        bad = [r for r in rows if r["problems"]]
        failed += len(bad)
        model = [row for b in batches for row in issue_model(rows, arch, text, [p for p in precisions
                                                                             if arch >= 89 or p != "fp8"], b, C,
                                                             dtype.itemsize, base)]
        result["archs"][str(arch)] = {"card": ARCHS[arch][0], "kernels": rows, "failed": len(bad),
                                      "issue_model": model, "seconds": round(time.perf_counter() - t0, 1)}
    result["failed"] = failed
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 1 if failed else 0


# one card per architecture for the issue model: (name, SMs, boost clock Hz, memory bandwidth B/s)
ISSUE_CARDS = {90: ("H100 SXM", 132, 1.98e9, 3.35e12), 89: ("RTX 4090", 128, 2.52e9, 1.008e12),
               86: ("RTX 3090", 82, 1.695e9, 0.936e12), 80: ("A100 SXM", 108, 1.41e9, 2.039e12),
               120: ("RTX 5090", 170, 2.41e9, 1.792e12)}
BYTES_PER_WEIGHT = {"native": 2.0, "fp8": 1.0 + 4 / 2816, "int4": 0.5 + 2 / 64}  # with their scales
LOADED_LATENCY_S = 1e-6  # device-memory latency under full load, assumed (idle: ~0.5-0.8 us): Little's law below


def in_flight_per_sm(row: dict, block_m: int, block_n: int, block_k: int, act_bytes: int, weight_bytes: float,
                     matrices: int) -> float:
    """Bytes a kernel keeps in flight per SM by its cp.async pipeline: resident blocks x (stages - 1) tiles
    issued ahead x one stage's bytes (the activation tile and `matrices` weight tiles)."""
    stage = block_m * block_k * act_bytes + matrices * block_n * block_k * weight_bytes
    return row["blocks_per_sm"] * max(row["num_stages"] - 1, 0) * stage


def issue_model(rows: list[dict], arch: int, text, precisions: list[str], batch: int, canvas: int,
                act_bytes: int = 2, tiles=None) -> list[dict]:
    """Instruction issue vs bytes for the expert kernels of one denoising step, from the compiled K-tile loops at
    the default tiles: issue ms = weights x loop instructions per weight / 32 lanes / (SMs x 4 schedulers x clock),
    bytes ms = expert bytes / bandwidth. A static model (perfect overlap, boost clock, no stalls): it says which
    side bounds a kernel, not its time. Also the bytes each kernel keeps in flight per SM (in_flight_per_sm)
    against Little's law, bandwidth x loaded latency / SMs: fewer, and no kernel reaches the bandwidth whatever
    its instructions; and the bytes a step reads from L2 (l2_to_sm_bytes), to set against the card's L2 rate
    (benchmarks/l2_bandwidth.py)."""
    from blockpress.kernels.moe_grouped import auto_block_m, default_tiles, expected_m_blocks, int4_block_k
    from blockpress.kernels.quant import expert_format, group_for

    name, sms, clock, bandwidth = ISSUE_CARDS[arch]
    E, H, Im, L = text.num_experts, text.hidden_size, text.moe_intermediate_size, text.num_hidden_layers
    issue_rate = sms * 4 * clock
    out = []
    print(f"\nissue model, {name} (sm_{arch}: {sms} SMs x 4 schedulers x {clock / 1e9:.2f} GHz, "
          f"{bandwidth / 1e12:.2f} TB/s), expert kernels of a step at canvas x{batch}, default tiles:")
    need = bandwidth * LOADED_LATENCY_S / sms
    print(f"{'experts':<8} {'BM':>3} {'blocks/expert':>13} {'instr/weight up':>15} {'down':>6} {'issue ms':>9} {'bytes ms':>9}  {'bound':<12} "
          f"{'L2->SM GB':>9} {'x HBM':>6}  KB in flight per SM, up / down (Little's law: {need / 1024:.0f} KB at "
          f"{LOADED_LATENCY_S * 1e9:.0f} ns)")
    for precision in precisions:
        weights, a8 = expert_format(precision)
        TILES = tiles or default_tiles(weights, arch >= 90)  # noqa: N806 - the tiles the report reads
        bk = TILES.block_k
        if weights == "int4":  # the K tile the launcher runs (QuantizedExperts' default groups of 64)
            bk = int4_block_k(bk, (group_for(H, 64), group_for(Im, 64)))
        per, flight = {}, {}
        bm = TILES.block_m or auto_block_m(batch * canvas, text.top_k_experts, E, arch >= 90, TILES.swap)
        for kernel, matrices in (("_moe_up_kernel", 2), ("_moe_down_kernel", 1)):
            want = f"experts {precision}, canvas x{batch}, tiles {TILES.spec()}"
            r = next((r for r in rows if r["kernel"] == kernel and want in (r["label"], *r["also_for"]) and r["loop"]),
                     None)
            if r is None:
                break
            per[kernel] = r["loop"] / (matrices * TILES.block_n * bk / (32 * r["num_warps"]))
            flight[kernel] = in_flight_per_sm(r, bm, TILES.block_n, bk, 1 if a8 else act_bytes,
                                              BYTES_PER_WEIGHT[weights], matrices)
        if len(per) < 2:
            continue
        up_w, down_w = L * E * 2 * Im * H, L * E * H * Im
        # each expert's weights are dequantised once per M block of its tokens (expected under uniform random
        # routing: Binomial(tokens, K / E) assignments an expert, not the mean), and a partial last N tile issues a
        # full tile's instructions (704 = 5.5 x 128)
        m_blocks = expected_m_blocks(batch * canvas, text.top_k_experts, E, bm)
        waste = {"_moe_up_kernel": -(-Im // TILES.block_n) * TILES.block_n / Im,
                 "_moe_down_kernel": -(-H // TILES.block_n) * TILES.block_n / H}
        issue = m_blocks * (up_w * per["_moe_up_kernel"] * waste["_moe_up_kernel"]
                            + down_w * per["_moe_down_kernel"] * waste["_moe_down_kernel"]) / 32 / issue_rate * 1e3
        mem = (up_w + down_w) * BYTES_PER_WEIGHT[weights] / bandwidth * 1e3
        l2 = l2_to_sm_bytes(text, batch * canvas, bm, TILES.block_n, BYTES_PER_WEIGHT[weights],
                            1 if a8 else act_bytes)
        row = {"experts": precision, "card": name, "batch": batch, "up_instr_per_weight": round(per["_moe_up_kernel"], 2),
               "down_instr_per_weight": round(per["_moe_down_kernel"], 2), "m_blocks_per_expert": round(m_blocks, 3), "block_m": bm,
               "issue_ms": round(issue, 2), "bytes_ms": round(mem, 2),
               "bound": "instructions" if issue > mem else "memory", "l2_to_sm_gb": round(l2 / 1e9, 2),
               "l2_to_sm_over_hbm": round(l2 / (mem / 1e3 * bandwidth), 2),
               "in_flight_kb_per_sm": {k.split("_")[2]: round(v / 1024, 1) for k, v in flight.items()},
               "in_flight_kb_needed": round(need / 1024, 1)}
        out.append(row)
        print(f"{precision:<8} {bm:>3} {m_blocks:>13.3f} {row['up_instr_per_weight']:>15.2f} {row['down_instr_per_weight']:>6.2f} "
              f"{issue:>9.2f} {mem:>9.2f}  {row['bound']:<12} {row['l2_to_sm_gb']:>9.2f} "
              f"{row['l2_to_sm_over_hbm']:>6.2f}  {flight['_moe_up_kernel'] / 1024:.0f} / "
              f"{flight['_moe_down_kernel'] / 1024:.0f}")
    return out


def l2_to_sm_bytes(text, tokens: int, bm: int, bn: int, weight_bytes: float, act_bytes: int) -> float:
    """Bytes the expert kernels of one step read from L2 into the SMs (uniform random routing): every program reads its
    weight slice (each expert's weights once per M block) and its M block's activation rows over the whole K
    (the up kernel: x [bm, H]; the down kernel: act [bm, Im]), so the activations are read once per N tile:
    Im / bn times by the up kernel, H / bn by the down kernel. Weights come from HBM once; the activations, small,
    from L2 after the first read. Against HBM bytes this says how much L2 bandwidth a step needs on top."""
    from blockpress.kernels.moe_grouped import expected_m_blocks

    E, H, Im, K, L = (text.num_experts, text.hidden_size, text.moe_intermediate_size, text.top_k_experts,
                      text.num_hidden_layers)
    m_blocks = E * expected_m_blocks(tokens, K, E, bm)  # total M blocks, uniform random routing
    up = m_blocks * (2 * Im * H * weight_bytes + bm * H * act_bytes * -(-Im // bn))
    down = m_blocks * (H * Im * weight_bytes + bm * Im * act_bytes * -(-H // bn))
    return L * (up + down)


def print_table(rows: list[dict], arch: int) -> None:
    from blockpress.lab.aot import ARCHS

    print(f"\nsm_{arch} ({ARCHS[arch][0]}): {len(rows)} distinct kernels")
    head = f"{'kernel':<22} {'launch (first of its kind)':<58} {'warps':>5} {'regs':>4} {'spill':>5} " \
           f"{'smem KB':>7} {'blk/SM':>6} {'mma':<8} {'SASS':>5} {'loop':>4}  global loads B:count: ld / cp.async / " \
           f"ld in the loop"
    print(head)
    print("-" * len(head))
    for r in rows:
        asy = r.get("async_loads", {})
        plain = {w: n - asy.get(w, 0) for w, n in r["loads"].items() if n > asy.get(w, 0)}
        loads = " / ".join(" ".join(f"{w}:{n}" for w, n in d.items()) or "-"
                           for d in (plain, asy, r.get("loop_plain_loads", {})))
        label = r["label"] + (f" (+{r['also']})" if r["also"] else "")
        print(f"{r['kernel']:<22} {label[:58]:<58} {r['num_warps']:>5} {r['regs']:>4} {r['spill']:>5} "
              f"{r['shared'] / 1024:>7.1f} {r['blocks_per_sm']:>6} {r['mma']:<8} {r['sass']:>5} {r['loop']:>4}  "
              f"{loads}")
        for problem in r["problems"]:
            print(f"{'':<22} !! {problem}")


if __name__ == "__main__":
    sys.exit(main())
