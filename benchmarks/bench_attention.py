"""One layer's attention in a fixed-shape denoising pass, per kind of layer: today's path against the Triton kernel.

Today's path (model/keys.py `Fixed` without `ops.fixed_attention`): the canvas's K/V written into the cache, a mask
over the cache built from the device position (once per pass, timed apart), a sliding layer's window gathered from
its ring, then `attention_sdpa_gqa` (SDPA's memory-efficient kernel with the mask). The kernel
(kernels/attention_fixed.py, `--attention-kernel`): the same write, then one kernel over the cache buffers in place.
Both from the same cache, positions and queries; their outputs are compared (relative Frobenius error) so a fast
wrong kernel shows. The per-step estimate sums each kind of layer's time over the model's layers.

    python benchmarks/bench_attention.py                         # the 26B shapes at batch 1, ~2K cached tokens (GPU)
    python benchmarks/bench_attention.py --tiles "dv=128|bm=128,bn=32|sliding:bn=16,stages=3|split=2"  # + variants
    (attention tiles specs, as `blockpress tune` keeps them; split=k: the keys of a row block in k runs, k times the
    programs, merged by a second kernel)
    python benchmarks/bench_attention.py --preset tiny --device cpu  # the interpreter: a check that it runs

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from blockpress.cli.run import _positive_int  # noqa: E402

def parse_variants(arg: str) -> list[str]:
    """--tiles: attention tiles specs joined by '|' (kernels/attention_fixed.py `parse_attention_tiles`; ValueError
    naming the bad one)."""
    from blockpress.kernels.attention_fixed import parse_attention_tiles

    specs = [s.strip() for s in arg.split("|") if s.strip()]
    for spec in specs:
        parse_attention_tiles(spec)
    return specs


def main(argv=None) -> int:
    from blockpress.config import FULL, SLIDING, ModelConfig
    from blockpress.kernels._triton import usable_on
    from blockpress.kernels.attention import attention_sdpa_gqa
    from blockpress.kernels.attention_fixed import fixed_attention_triton, kind_tiles, tiles_for
    from blockpress.lab.bench import DTYPES
    from blockpress.lab.presets import preset_config
    from blockpress.lab.profile import time_ms
    from blockpress.model.cache import KVCache
    from blockpress.model.keys import Fixed
    from blockpress.model.ops import Ops

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="real-26b", choices=["tiny", "small", "real-26b"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--cached", type=_positive_int, default=2048, help="cached tokens before the canvas")
    p.add_argument("--tiles", default="", help="kernel tile variants to time beside the defaults, '|' between "
                                               "them, e.g. 'bm=64,bn=64,warps=8|full:dv=128' (bm, bn, dv, warps, "
                                               "stages, split; 'kind:' for one kind of layer)")
    p.add_argument("--out", help="also write the JSON result here")
    args = p.parse_args(argv)
    try:
        variants = [""] + parse_variants(args.tiles)
    except ValueError as e:
        raise SystemExit(f"--tiles: {e}") from None
    dev = torch.device(args.device)
    if not usable_on(dev):
        raise SystemExit(f"the Triton kernel does not run on {dev} here (a CPU needs TRITON_INTERPRET=1)")
    dtype = DTYPES[args.dtype or ("bf16" if dev.type == "cuda" else "fp32")]
    cfg = ModelConfig.from_dict(preset_config(args.preset)[0])
    text, C, B, T = cfg.text, cfg.canvas_length, args.batch, args.cached
    kinds = [t for t in (SLIDING, FULL) if t in text.layer_types]
    first = {t: text.layer_types.index(t) for t in kinds}
    shapes = [(text.layer_kv_heads(first[t]), text.layer_head_dim(first[t])) for t in kinds]
    reserve = max(2048, 2 * C)  # the engine's caches: a ring of window + reserve once that is smaller
    cache = KVCache(shapes, B, T + 2 * C, dtype, dev, sliding=[t == SLIDING for t in kinds], window=text.sliding_window,
                    reserve=reserve)
    g = torch.Generator(device=dev).manual_seed(0)
    for buf in cache.keys + cache.values:
        buf.copy_(torch.randn(buf.shape, generator=g, device=dev, dtype=torch.float32))
    cache.length = T
    start = torch.tensor(T, device=dev)
    model = types.SimpleNamespace(window=text.sliding_window, bidirectional_encoder=False, ops=Ops())
    masks_ms = time_ms(lambda: Fixed(model, cache, start, 0, C, dtype), dev)
    H = text.num_attention_heads
    rows, step = [], {"today": masks_ms}
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"bench_attention: {args.preset}, {dev} ({card}), "
          f"{str(dtype).removeprefix('torch.')}, batch {B}, canvas {C} after {T} cached tokens; the pass's masks "
          f"(today's path, once a pass): {masks_ms:.3f} ms")
    print(f"{'layer':<8} {'D':>4} {'G':>2} {'slots':>6} {'tiles':<34} {'today ms':>9} {'kernel ms':>9} {'x':>5} "
          f"{'rel err':>8}")
    for i, t in enumerate(kinds):
        kv, D = shapes[i]
        q, k, v = (torch.randn(B, n, C, D, generator=g, device=dev, dtype=torch.float32).to(dtype) / D ** 0.25
                   for n in (H, kv, kv))
        layer = (cache.keys[i], cache.values[i])
        today = Fixed(model, cache, start, 0, C, dtype)
        want = today.attend(layer, t, q, k, v, attention_sdpa_gqa)
        today_ms = time_ms(lambda: today.attend(layer, t, q, k, v, attention_sdpa_gqa), dev)
        n_layers = text.layer_types.count(t)
        step["today"] += n_layers * today_ms
        for variant in variants:
            tiles = dict(kind_tiles(variant, text.sliding_window if t == SLIDING else 0))
            if variant and not tiles:  # a variant for the other kind of layer
                continue
            if D % tiles.get("DV", D) or tiles.get("DV", D) < 16:  # a column tile this head dim cannot take
                print(f"{t.split('_')[0]:<8} {D:>4} {H // kv:>2} {cache.keys[i].shape[2]:>6} DV={tiles['DV']}: "
                      f"not a divisor of the head dim, skipped")
                continue
            kernel = Ops(fixed_attention=lambda *a, tiles=tiles: fixed_attention_triton(*a, tiles=tiles))
            fast = Fixed(types.SimpleNamespace(**{**vars(model), "ops": kernel}), cache, start, 0, C, dtype)
            got = fast.attend(layer, t, q, k, v, attention_sdpa_gqa)
            err = float((got.float() - want.float()).norm() / want.float().norm())
            ms = time_ms(lambda: fast.attend(layer, t, q, k, v, attention_sdpa_gqa), dev)
            spec = ",".join(f"{k}={v}" for k, v in {**tiles_for(D), **tiles}.items())
            name = "kernel" if not tiles else f"kernel {spec}"
            step[name] = step.get(name, 0.0) + n_layers * ms
            rows.append({"layer": t, "head_dim": D, "group": H // kv, "slots": cache.keys[i].shape[2], "tiles": spec,
                         "today_ms": today_ms, "kernel_ms": ms, "rel_err": err, "layers": n_layers})
            print(f"{t.split('_')[0]:<8} {D:>4} {H // kv:>2} {cache.keys[i].shape[2]:>6} {spec[:34]:<34} "
                  f"{today_ms:>9.3f} {ms:>9.3f} {today_ms / ms:>5.2f} {err:>8.1e}")
    print("per step (" + ", ".join(f"{text.layer_types.count(t)} {t.split('_')[0]}" for t in kinds) + "): " +
          ", ".join(f"{k} {v:.3f} ms" for k, v in step.items()) + " (today's includes the masks)")
    result = {"bench": "attention", "preset": args.preset, "device": str(dev), "dtype": str(dtype), "batch": B,
              "cached": T, "canvas": C, "masks_ms": masks_ms, "rows": rows, "step_ms": step}
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
