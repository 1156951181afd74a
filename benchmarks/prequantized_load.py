"""Loading quantised weights: a pre-quantised checkpoint (what `blockpress convert` writes, compressed-tensors'
layout) against the bf16 checkpoint quantised while it loads. A random-weight model of a preset, one torch thread,
alternating, the median of --repeats loads each. --storage: fp8 (experts and projections) or int4 (int4 experts
by groups of 64, int8 projections).

    python benchmarks/prequantized_load.py [--preset small] [--storage fp8|int4] [--repeats 5] [--device cpu]
    python benchmarks/prequantized_load.py --preset real-26b --layers 2 --vocab 8192 --repeats 3   # its real shapes

Prints the two checkpoints' sizes and load times (and that both loads hold the same bytes), then a JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import blockpress
from blockpress.lab.presets import PRESETS, preset_config

STORAGE = {"fp8": dict(precision="fp8", linears="fp8"), "int4": dict(precision="int4", group_size=64, linears="int8")}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=list(PRESETS), default="small")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (real-26b: 2 fit a 24 GB host)")
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (the experts' shapes stay)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--storage", choices=list(STORAGE), default="fp8")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config, _, _ = preset_config(args.preset)
    text = config["text_config"]
    if args.layers:
        text["num_hidden_layers"] = args.layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:args.layers]
    if args.vocab:
        text["vocab_size"] = args.vocab
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = blockpress.from_config(config, dtype=torch.bfloat16, seed=0).save(Path(tmp) / "bf16")
        opts = STORAGE[args.storage]
        quant = blockpress.load(bf16, device=args.device, dtype="bfloat16", progress=False, **opts).save(
            Path(tmp) / args.storage)
        sizes = {name: sum(f.stat().st_size for f in d.iterdir()) for name, d in (("bf16", bf16), (args.storage, quant))}
        kw = dict(device=args.device, dtype="bfloat16", progress=False)
        mine = f"{args.storage} checkpoint"
        loads = {"quantise at load": lambda: blockpress.load(bf16, **opts, **kw),
                 mine: lambda: blockpress.load(quant, **kw)}
        times: dict[str, list[float]] = {k: [] for k in loads}
        held = {}
        for _ in range(args.repeats):
            for name, fn in loads.items():
                t = time.perf_counter()
                lm = fn()
                times[name].append(time.perf_counter() - t)
                held[name] = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
                              for k, v in lm.module.state_dict().items()}
    same = held["quantise at load"].keys() == held[mine].keys() and all(
        torch.equal(held["quantise at load"][k], held[mine][k]) for k in held[mine])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.preset} ({text['num_hidden_layers']} layers, vocab {text['vocab_size']}), {args.device}, "
          f"{args.repeats} loads each, one thread")
    print(f"  checkpoint size: bf16 {sizes['bf16'] / 1e6:.1f} MB, {args.storage} {sizes[args.storage] / 1e6:.1f} MB")
    for k, v in med.items():
        print(f"  {k:18s} {v * 1e3:8.1f} ms (median; runs {', '.join(f'{x * 1e3:.0f}' for x in times[k])})")
    print(f"  the same bytes either way: {same}")
    out = {"bench": "prequantized_load", "storage": args.storage, "options": opts, "preset": args.preset, "layers": text["num_hidden_layers"],
           "vocab": text["vocab_size"], "device": args.device, "repeats": args.repeats,
           "bytes": sizes, "median_s": med, "runs_s": times, "same_weights": same}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
