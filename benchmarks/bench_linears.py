"""The int8 linear kernel against bf16 `F.linear` (cuBLAS) on the real model's projection shapes.

`--linears int8` halves the bytes of the attention and dense-MLP projections; whether a step gets faster
depends on this kernel: at 256 rows (one canvas) a projection sits near the GPU's ridge point, at one row
(an AR step) it is purely bandwidth-bound, from 512 rows on compute-bound. For every projection shape of a
config (sliding and full attention layers, dense MLP) and every row count in `--rows`, this times the
bf16 matmul and the int8 Triton kernel (`triton.testing.do_bench` on CUDA, the best of `--repeats` on a
CPU), checks the kernel against the dequantising reference (exits 1 past 2e-2 relative), and prints ms,
achieved GB/s (weight bytes / time) and TFLOP/s per shape, then the per-pass totals (each shape times the
number of layers that have it) and the speedup.

    python benchmarks/bench_linears.py --preset real-26b                      # H100/H200, < 1 min (estimated)
    TRITON_INTERPRET=1 python benchmarks/bench_linears.py --preset tiny --rows 1,16 --repeats 1   # CPU check

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from blockpress.kernels.profile import time_ms


def projection_shapes(text) -> dict[tuple[int, int], int]:
    """(in, out) -> how many projections of one pass have that shape (all layers)."""
    shapes: dict[tuple[int, int], int] = {}
    H = text.hidden_size
    for i in range(text.num_hidden_layers):
        heads, kv, D = text.num_attention_heads, text.layer_kv_heads(i), text.layer_head_dim(i)
        layer = [(H, heads * D), (H, kv * D), (heads * D, H)]  # q, k, o
        if not text.is_full(i):
            layer.append((H, kv * D))  # v (full layers: k = v)
        layer += [(H, text.intermediate_size)] * 2 + [(text.intermediate_size, H)]  # gate, up, down
        for s in layer:
            shapes[s] = shapes.get(s, 0) + 1
    return shapes


def main(argv=None) -> int:
    from blockpress.cli.bench import PRESETS, preset_config
    from blockpress.config import ModelConfig
    from blockpress.kernels.linear_q import Int8Linear, linear_int8_triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="real-26b")
    p.add_argument("--rows", default="1,256,512,1024", help="activation rows: 1 = AR step, 256 = a canvas")
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=3, help="CPU: timed calls per setting (best taken)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    text = ModelConfig.from_dict(preset_config(args.preset)[0]).text
    rows = [int(r) for r in args.rows.split(",") if r]
    shapes = projection_shapes(text)
    g = torch.Generator(device=device).manual_seed(0)
    results, ok = [], True
    print(f"{args.preset} projections on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{str(dtype).removeprefix('torch.')} activations")
    print(f"{'in x out':>12} {'count':>5} {'rows':>5} {'native ms':>10} {'int8 ms':>9} {'native GB/s':>12} "
          f"{'int8 GB/s':>10} {'int8 TFLOP/s':>13} {'speedup':>8} {'rel err':>8}")
    for (I, O), count in sorted(shapes.items()):
        w = torch.randn(O, I, generator=g, device=device, dtype=torch.float32).div_(I ** 0.5).to(dtype)
        lin = torch.nn.Linear(I, O, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        q = Int8Linear.from_linear(lin, backend="torch")
        for M in rows:
            x = torch.randn(M, I, generator=g, device=device, dtype=torch.float32).to(dtype)
            with torch.no_grad():
                ref = q(x)
                err = float((linear_int8_triton(x, q.weight_q, q.weight_scale).float() - ref.float()).norm()
                            / ref.float().norm())
                t_native = time_ms(lambda: torch.nn.functional.linear(x, w), device, args.repeats)
                t_int8 = time_ms(lambda: linear_int8_triton(x, q.weight_q, q.weight_scale), device, args.repeats)
            ok &= err <= 2e-2
            r = {"in": I, "out": O, "count": count, "rows": M, "native_ms": t_native, "int8_ms": t_int8,
                 "native_gbs": w.numel() * w.element_size() / t_native / 1e6,
                 "int8_gbs": q.weight_bytes() / t_int8 / 1e6, "int8_tflops": 2 * M * I * O / t_int8 / 1e9,
                 "rel_err": err}
            results.append(r)
            print(f"{f'{I}x{O}':>12} {count:5d} {M:5d} {t_native:10.4f} {t_int8:9.4f} {r['native_gbs']:12.0f} "
                  f"{r['int8_gbs']:10.0f} {r['int8_tflops']:13.1f} {t_native / t_int8:7.2f}x {err:8.1e}")
    totals = {}
    for M in rows:
        nat = sum(r["native_ms"] * r["count"] for r in results if r["rows"] == M)
        i8 = sum(r["int8_ms"] * r["count"] for r in results if r["rows"] == M)
        totals[M] = {"native_ms": nat, "int8_ms": i8, "speedup": nat / i8}
        print(f"  one pass, {M:5d} rows: native {nat:8.3f} ms, int8 {i8:8.3f} ms ({nat / i8:.2f}x)")
    print(json.dumps({"bench": "linears", "preset": args.preset, "device": str(device),
                      "dtype": str(dtype).removeprefix("torch."), "ok": ok, "totals_per_pass": totals,
                      "results": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
