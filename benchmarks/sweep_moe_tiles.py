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
import json
import sys

import torch

from blockpress.cli.run import _group_size
from blockpress.cli.run import _positive_int
from blockpress.lab.tune import DEFAULT_GRID, build_layer, fastest, routed_tokens, sweep_tiles, tolerance


def parse_grid(text: str) -> list[str]:
    """`blockpress.lab.tune.parse_grid` for this script's --grid: SystemExit naming the problem."""
    from blockpress.lab.tune import parse_grid as parse

    try:
        return parse(text)
    except ValueError as e:
        raise SystemExit(f"--grid: {e}") from None


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
    x, w, idx = routed_tokens(text, N, device, dtype, args.seed, args.mlp)
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

        def report(row, i, n, precision=precision):
            row["precision"] = precision
            status = row.get("failed") or (f"{row['ms']:.3f} ms  {row['gbs']:.0f} GB/s  "
                                           f"{row['floor_fraction']:.0%} of copy  err {row['rel_err_vs_first']:.1e}")
            print(f"  [{precision} {i}/{n}] {row['spec']:<40} {status}", flush=True)

        rows, vs_torch = sweep_tiles(call, reference, x, w, idx, specs, device, args.repeats, report, floor_bytes,
                                     bandwidth)
        result.setdefault("rel_err_vs_torch", {})[precision] = vs_torch
        timed, best = [r for r in rows if r.get("ok")], fastest(rows)
        if best is not None:
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
    tol = tolerance(dtype)
    wrong = {k: v for k, v in result.get("rel_err_vs_torch", {}).items() if not v < tol}
    if wrong:
        print(f"sweep_moe_tiles: the Triton kernel disagrees with the torch reference: {wrong}", file=sys.stderr)
        return 1
    return 0 if len(result["best"]) == len(precisions) else 1


if __name__ == "__main__":
    sys.exit(main())
