"""The 8-bit linear kernels against bf16 `F.linear` (cuBLAS) on the real model's projection shapes.

`--linears int8` halves the bytes of the attention and dense-MLP projections; whether a step gets faster
depends on this kernel: at 256 rows (one canvas) a projection sits near the GPU's ridge point, at one row
(an AR step) it is purely bandwidth-bound, from 512 rows on compute-bound. For every projection shape of a
config (sliding and full attention layers, dense MLP) and every row count in `--rows`, this times the
bf16 matmul, the weight-only Triton kernel with int8 and with fp8 weights, and fp8 x fp8 (w8a8, on fp8-capable
GPUs: our kernel, `experts="w8a8"`'s projections, and `torch._scaled_mm`) (`triton.testing.do_bench` on CUDA, the
best of `--repeats` on a CPU), checks each against its reference (the dequantising `F.linear`; the w8a8 arithmetic
in fp32; exits 1 past 2e-2 relative), and prints ms and the speedup per shape, then the per-pass totals (each
shape times the number of layers that have it).

    python benchmarks/bench_linears.py --preset real-26b                      # H100/H200, < 1 min (estimated)
    TRITON_INTERPRET=1 python benchmarks/bench_linears.py --preset tiny --rows 1,16 --repeats 1   # CPU check

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blockpress.cli.run import _positive_int, _positive_int_list
from blockpress.lab.profile import time_ms
from blockpress.lab.tune import LINEAR_SPECS, projection_shapes


def main(argv=None) -> int:
    from blockpress.lab.presets import PRESETS, preset_config
    from blockpress.config import ModelConfig
    from blockpress.kernels.linear_q import (QuantizedLinear, linear_fp8_scaled_mm, linear_fp8_w8a8_reference,
                                             linear_q_triton, parse_linear_tiles)

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="real-26b")
    p.add_argument("--rows", type=_positive_int_list, default="1,256,512,1024",
                   help="activation rows: 1 = AR step, 256 = a canvas")
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=_positive_int, default=3, help="CPU: timed calls per setting (best taken)")
    p.add_argument("--fused", action="store_true",
                   help="the shapes of a pass with q/k/v and gate/up fused into one projection each (205 -> 120 "
                        "GEMMs on the 26B model): is a horizontal fusion worth building?")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # fp8 x fp8 needs fp8 tensor cores on a GPU (Ada, Hopper); torch._scaled_mm also runs on a CPU
    w8a8 = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    # the kernel's variants by their tiles spec (what `blockpress bench --linear-tiles` takes; the candidates
    # `blockpress tune` times, lab/tune.py says why each): weight-only int8, and our fp8 x fp8 (experts="w8a8"'s
    # projections: the row quantiser, then fp8 x fp8 dots); fp8-a8 scaled_mm: the same function through
    # torch._scaled_mm
    int8_specs, a8_specs = LINEAR_SPECS["int8"], LINEAR_SPECS["fp8-a8"]
    variants = [f"int8 {sp}" for sp in int8_specs] + ["fp8"] + \
        ([f"fp8-a8 {sp}" for sp in a8_specs] + ["fp8-a8 scaled_mm"] if w8a8 else [])
    text = ModelConfig.from_dict(preset_config(args.preset)[0]).text
    rows = [int(r) for r in args.rows.split(",") if r]
    shapes = projection_shapes(text, fused=args.fused)
    g = torch.Generator(device=device).manual_seed(0)
    results, ok = [], True
    print(f"{args.preset} projections on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{str(dtype).removeprefix('torch.')} activations; ms per call (speedup over native), max rel. error")
    print("variants: " + ", ".join(f"v{i} = {v}" for i, v in enumerate(variants)))
    print(f"{'in x out':>12} {'count':>5} {'rows':>5} {'native':>9} " + " ".join(f"{'v' + str(i):>16}"
                                                                               for i in range(len(variants)))
          + f" {'native GB/s':>12} {'max err':>8}")
    for (I, O), count in sorted(shapes.items()):
        w = torch.randn(O, I, generator=g, device=device, dtype=torch.float32).div_(I ** 0.5).to(dtype)
        lin = torch.nn.Linear(I, O, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        q = {fmt: QuantizedLinear.from_linear(lin, fmt, backend="torch") for fmt in ("int8", "fp8")}
        for M in rows:
            x = torch.randn(M, I, generator=g, device=device, dtype=torch.float32).to(dtype)
            calls = {f"int8 {sp}": ((lambda t=parse_linear_tiles(sp): linear_q_triton(
                x, q["int8"].weight_q, q["int8"].weight_scale, **t)), q["int8"]) for sp in int8_specs}
            calls.update({f"fp8-a8 {sp}": ((lambda t=parse_linear_tiles(sp): linear_q_triton(
                x, q["fp8"].weight_q, q["fp8"].weight_scale, **t, act8=True)), None) for sp in a8_specs})
            calls.update({
                "fp8": (lambda: linear_q_triton(x, q["fp8"].weight_q, q["fp8"].weight_scale), q["fp8"]),
                "fp8-a8 scaled_mm": (lambda: linear_fp8_scaled_mm(x, q["fp8"].weight_q, q["fp8"].weight_scale), None)})
            r = {"in": I, "out": O, "count": count, "rows": M, "native_gbs": 0.0, "rel_err": {}}
            with torch.no_grad():
                r["native_ms"] = time_ms(lambda: torch.nn.functional.linear(x, w), device, args.repeats)
                for v in variants:
                    fn, mod = calls[v]
                    ref = mod(x) if mod is not None else linear_fp8_w8a8_reference(x, q["fp8"].weight_q,
                                                                                   q["fp8"].weight_scale)
                    r["rel_err"][v] = float((fn().float() - ref.float()).norm() / ref.float().norm())
                    r[f"{v}_ms"] = time_ms(fn, device, args.repeats)
            r["native_gbs"] = w.numel() * w.element_size() / r["native_ms"] / 1e6
            ok &= max(r["rel_err"].values()) <= 2e-2
            results.append(r)
            cells = " ".join(f"{r[f'{v}_ms']:8.4f} ({r['native_ms'] / r[f'{v}_ms']:4.2f}x)" for v in variants)
            print(f"{f'{I}x{O}':>12} {count:5d} {M:5d} {r['native_ms']:9.4f} {cells} {r['native_gbs']:12.0f} "
                  f"{max(r['rel_err'].values()):8.1e}")
    totals, best = {}, {"int8": {}, "fp8-a8": {}}
    for M in rows:
        mine = [r for r in results if r["rows"] == M]
        totals[M] = {v: sum(r[f"{v}_ms"] * r["count"] for r in mine) for v in ["native"] + variants}
        print(f"  one pass, {M:5d} rows: " + ", ".join(f"{v} {ms:.3f} ms" for v, ms in totals[M].items()))
        for fmt, specs in (("int8", int8_specs), ("fp8-a8", a8_specs if w8a8 else [])):  # the spec for --linear-tiles
            if specs:
                best[fmt][M] = min(specs, key=lambda sp: totals[M][f"{fmt} {sp}"])
    print(json.dumps({"bench": "linears", "preset": args.preset, "device": str(device), "fused": args.fused,
                      "dtype": str(dtype).removeprefix("torch."), "variants": variants, "ok": ok,
                      "totals_ms_per_pass": totals, "best_int8_spec": best["int8"], "best_a8_spec": best["fp8-a8"],
                      "results": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
