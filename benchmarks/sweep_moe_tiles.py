"""Tile sweep of the Triton expert kernels on ONE layer of a real config, against that layer's byte floor.

A denoising step of the 26B-A4B model is ~95 % expert weights, so the two expert kernels decide how close
a step gets to the bandwidth floor. Their default tiles (block_m sized for the spread of the routing:
`moe_grouped.auto_block_m`; BN 128, BK 64, Triton's default warps, stages fitted to the device) are untimed. This script builds one
layer's experts (random weights on the device: bf16, fp8 or int4) and a canvas's routing (B x C tokens,
top-K of a random router), then times every tile setting of a grid (`triton.testing.do_bench` on CUDA,
the best of `--repeats` on a CPU) and reports ms, achieved GB/s (the layer's hit expert bytes / time) and
the fraction of the measured copy bandwidth. The first setting (the engine's defaults for the precision on this
device, `moe_grouped.default_tiles`) is checked against the plain-torch experts, and every other setting against
the first (same function: only the summation tiling differs); the script exits 1 on a disagreement. A setting Triton cannot compile (shared memory,
registers) is listed as failed, not fatal. With int4, a BK larger than the scale group is halved until it
fits (so bk=128 and bk=64 can be the same kernel there).

    python benchmarks/sweep_moe_tiles.py --preset real-26b --precision native,fp8,int4      # H100/H200 (~2 min, estimated)
    TRITON_INTERPRET=1 python benchmarks/sweep_moe_tiles.py --preset tiny --grid "bm=16;bn=16,32;bk=16"  # CPU
    python benchmarks/sweep_moe_tiles.py --mlp --precision int4 --grid "bm=auto,64;bn=32,64,128;bk=64,128"
                                              # the dense MLP as --linears int4-mlp runs it, on the experts' kernels

Ends with one JSON line; its "best" gives, per precision, the spec to pass on:
    blockpress bench --preset real-26b --experts triton --moe-tiles <spec> ...
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from blockpress.cli.run import _group_size
from blockpress.cli.run import _positive_int
from blockpress.lab.profile import time_ms

# 18 settings (+ the defaults, which are among them), then the M tile alone at the default N and K tiles (bm=auto
# sizes it for the spread of the routing, from compile_report.py's issue model: a timing has to confirm it); ~2.5 min on an H100, estimated, not yet run. BK 32 and BN 64
# stay in: the defaults moved to BK 64 and BN 128 on compile_report.py's static model (instructions, L2 traffic),
# a timing has to confirm them; BN 256 reads the activations from L2 half as often again (int4 at batch 1: 14.1 GB
# a step against 16.1 at BN 128) for as many instructions, but 255 registers from bm 64 on
DEFAULT_GRID = "bm=auto;bn=64,128,256;bk=32,64,128;warps=4,8|bm=16,32,64|bm=auto,16,32;bn=64,128;bk=64,128;swap=1"


def parse_grid(text: str) -> list[str]:
    """'bm=16,32;bn=64' -> ['bm=16,bn=64', 'bm=32,bn=64'] (every combination, each checked by parse_tiles); grids
    joined by '|' are taken one after the other ('bm=auto;bn=64,128|bm=16,32': four settings)."""
    from blockpress.kernels.moe_grouped import parse_tiles

    specs = []
    for grid in text.split("|"):
        axes = []
        for part in filter(None, (p.strip() for p in grid.split(";"))):
            key, _, vals = part.partition("=")
            if not vals:
                raise SystemExit(f"bad --grid part {part!r}: use key=v1,v2 parts separated by ';'")
            axes.append([f"{key.strip()}={v.strip()}" for v in vals.split(",") if v.strip()])
        specs += [s for s in (",".join(combo) for combo in itertools.product(*axes)) if s not in specs]
    specs = specs or [""]
    for spec in specs:
        try:
            parse_tiles(spec)
        except ValueError as e:
            raise SystemExit(f"--grid: {e}") from None
    return specs


def build_layer(text, precision: str, device, dtype, group_size: int, seed: int, mlp: bool = False):
    """One layer's experts: (call(x, w, idx, tiles) -> [N, H], reference(x, w, idx) -> [N, H] in plain torch,
    expert bytes of the whole layer). mlp: the layer's dense MLP instead, as the one expert every token takes
    (`--linears int4-mlp`, kernels/quant.py QuantizedMLP)."""
    from blockpress.kernels.moe_grouped import FMT_FP8, FMT_INT4, experts_triton
    from blockpress.kernels.quant import QuantizedExperts, expert_format, experts_w8a8_torch
    from blockpress.model.moe import experts_loop

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


def main(argv=None) -> int:
    from blockpress.lab.bench import DTYPES
    from blockpress.lab.presets import preset_config
    from blockpress.config import ModelConfig
    from blockpress.kernels._triton import triton, usable_on
    from blockpress.kernels.moe_grouped import _wgmma_target, default_tiles, parse_tiles
    from blockpress.kernels.quant import expert_format
    from blockpress.lab.roofline import expected_hit_fraction, measure_bandwidth
    from blockpress.loading import parse_device

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="real-26b", choices=["tiny", "small", "real-26b"])
    p.add_argument("--config", help="a config.json (diffusion_gemma) instead of a preset")
    p.add_argument("--precision", default="native,fp8,int4",
                   help="comma-separated: native, fp8, int4, fp8-a8 (fp8 weights and activations: experts='w8a8')")
    p.add_argument("--batch", type=int, default=1, help="rows of the canvas batch (tokens = batch x canvas)")
    p.add_argument("--grid", default=None, help=f"tile grid (default on CUDA: {DEFAULT_GRID!r}; on a CPU: "
                                                "the default tiles only)")
    p.add_argument("--group-size", type=_group_size, default=64, help="int4 scale group")
    p.add_argument("--device", help="cuda (default when available) or cpu (Triton interpreter)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="activation dtype (default bf16 on GPU, fp32 on CPU)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="CPU: best of this many runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlp", action="store_true", help="the layer's dense MLP as one expert every token takes (what "
                                                      "--linears int4-mlp runs) instead of its experts")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args(argv)

    device = parse_device(args.device)
    if not usable_on(device):
        raise SystemExit(f"Triton cannot run on {device} here: install triton (CUDA), or on a CPU set "
                         "TRITON_INTERPRET=1 before starting")
    precisions = [x for x in args.precision.split(",") if x]
    bad = sorted(set(precisions) - {"native", "fp8", "int4", "fp8-a8"})
    if bad or args.batch < 1:
        raise SystemExit(f"--precision takes native, fp8, int4, fp8-a8 (got {bad}); --batch must be >= 1")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    config = json.load(open(args.config)) if args.config else preset_config(args.preset)[0]
    cfg = ModelConfig.from_dict(config)
    text, C = cfg.text, cfg.canvas_length
    N, K, E = args.batch * C, text.top_k_experts, text.num_experts
    Im = text.moe_intermediate_size
    if args.mlp:
        K, E, Im = 1, 1, text.intermediate_size
    grid = parse_grid(args.grid if args.grid is not None else (DEFAULT_GRID if device.type == "cuda" else ""))
    defaults = {prec: default_tiles(expert_format(prec)[0], _wgmma_target(device)).spec() for prec in precisions}
    bandwidth = measure_bandwidth(device)
    hit = expected_hit_fraction(E, K, N)
    g = torch.Generator(device=device).manual_seed(args.seed + 1)
    x = torch.randn(N, text.hidden_size, generator=g, device=device).to(dtype)
    if args.mlp:  # every token to the one expert with weight 1, as QuantizedMLP routes
        w, idx = torch.ones(N, 1, device=device), torch.zeros(N, 1, dtype=torch.int64, device=device)
    else:
        probs = torch.softmax(torch.randn(N, E, generator=g, device=device), dim=-1)
        w, idx = torch.topk(probs, K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
    print(f"sweep_moe_tiles: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"{args.config or args.preset}, one layer{'s dense MLP' if args.mlp else ''}: E={E} H={text.hidden_size} "
          f"Im={Im} top-{K}, {N} tokens (batch {args.batch} x canvas {C}), copy bandwidth {bandwidth / 1e9:.0f} "
          f"GB/s, {len(grid)} tile settings x {len(precisions)} precisions (+ each one's defaults)", flush=True)
    result = {"bench": "moe_tiles", "device": str(device), "hardware": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "config": args.config or args.preset, "tokens": N, "mlp": args.mlp,
              "bandwidth_gbs": bandwidth / 1e9, "default": defaults, "results": [], "best": {}}
    for precision in precisions:
        TILES = parse_tiles(defaults[precision])  # noqa: N806 - the engine's defaults for this precision, first
        specs = [TILES.spec()] + [s for s in grid if parse_tiles(s).spec() != TILES.spec()]
        call, reference, layer_bytes = build_layer(text, precision, device, dtype, args.group_size, args.seed,
                                                   args.mlp)
        floor_bytes = layer_bytes * hit
        torch_out = reference(x, w, idx).float()
        ref = None
        rows = []
        for i, spec in enumerate(specs, 1):
            tiles = parse_tiles(spec)
            row = {"precision": precision, "spec": tiles.spec()}
            try:
                out = call(x, w, idx, tiles)
                if ref is None:  # the default tiles against plain torch: the compiled kernel is right
                    ref = out.float()
                    result.setdefault("rel_err_vs_torch", {})[precision] = float(
                        (ref - torch_out).abs().max() / torch_out.abs().max().clamp_min(1e-30))
                err = float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                ms = time_ms(lambda: call(x, w, idx, tiles), device, args.repeats)
                row.update(ms=ms, gbs=floor_bytes / (ms / 1e3) / 1e9, floor_fraction=floor_bytes / bandwidth / (ms / 1e3),
                           rel_err_vs_first=err, ok=err < (2e-2 if dtype != torch.float32 else 1e-4))
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result, not a crash
                row.update(failed=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
            rows.append(row)
            status = row.get("failed") or (f"{row['ms']:.3f} ms  {row['gbs']:.0f} GB/s  "
                                           f"{row['floor_fraction']:.0%} of copy  err {row['rel_err_vs_first']:.1e}")
            print(f"  [{precision} {i}/{len(specs)}] {row['spec']:<40} {status}", flush=True)
        timed = [r for r in rows if "ms" in r and r["ok"]]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            default = next((r for r in timed if r["spec"] == TILES.spec()), None)
            result["best"][precision] = {"spec": best["spec"], "ms": best["ms"], "gbs": best["gbs"],
                                         "floor_fraction": best["floor_fraction"],
                                         "speedup_vs_default": default["ms"] / best["ms"] if default else None}
        result["results"] += rows
        print(f"\n| {precision}: tiles | ms | GB/s | of copy bandwidth | rel. err |\n|---|---:|---:|---:|---:|")
        for r in sorted(timed, key=lambda r: r["ms"])[:10]:
            print(f"| {r['spec']} | {r['ms']:.3f} | {r['gbs']:.0f} | {r['floor_fraction']:.0%} | "
                  f"{r['rel_err_vs_first']:.1e} |")
        failed = [r for r in rows if "failed" in r or not r.get("ok", True)]
        if failed:
            print(f"({len(failed)} setting(s) failed or disagreed: see the JSON)")
        del call
        if device.type == "cuda":
            torch.cuda.empty_cache()
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    wrong = {k: v for k, v in result.get("rel_err_vs_torch", {}).items() if not v < tol}
    if wrong:
        print(f"sweep_moe_tiles: the Triton kernel disagrees with the torch reference: {wrong}", file=sys.stderr)
        return 1
    return 0 if len(result["best"]) == len(precisions) else 1


if __name__ == "__main__":
    sys.exit(main())
