"""CUDA-graph captures over a loop of prompts of many lengths: what an eval over a dataset, or any Python loop of
`generate` calls, pays for graphs.

Each generation's cache comes from the graphs' pool, and a pass is captured once per cache size. The engine rounds
a cache's capacity up to a power of two (`model.cache.rounded_capacity`), so a loop meets a few sizes. On a GPU
each capture is a warm-up run and a capture of the pass. On a CPU the same plumbing runs without capture, so the
count is what a GPU would capture, and the seconds mean little.

    python benchmarks/graph_captures.py                       # the shipped KJV model, 24 prompts, CPU
    python benchmarks/graph_captures.py --device cuda --preset small

Prints one line per call (prompt length, cache size, captures so far, seconds), then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import blockpress  # noqa: E402
from blockpress.testing import cuda_graphs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kjv", help="a model folder or a shipped model's name (default kjv)")
    p.add_argument("--preset", default=None, help="a random-weight preset instead (tiny, small, real-26b)")
    p.add_argument("--device", default=None)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-prompt", type=int, default=120, help="prompt lengths are drawn from 5..this")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.preset:
        from blockpress.lab.presets import preset_config

        config, _, _ = preset_config(args.preset)
        dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        lm = blockpress.from_config(config, seed=0, device=dev, experts="auto", attention="auto",
                                    dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    else:
        lm = blockpress.load(args.model, device=args.device, progress=False)
    rnd = random.Random(0)
    lengths = [rnd.randint(5, args.max_prompt) for _ in range(args.prompts)]
    V = lm.config.text.vocab_size
    kw = dict(max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, stability_threshold=None,
              confidence_threshold=None)
    rows = []
    with cuda_graphs(lm) as g:
        for n in lengths:
            ids = torch.randint(5, V, (1, n), generator=torch.Generator().manual_seed(n)).to(lm.device)
            before = g.captures
            t0 = time.perf_counter()
            out = lm.generate(ids, generator=torch.Generator(device=lm.device).manual_seed(1), **kw)
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"prompt": n, "cache": out.cache.capacity, "captured": g.captures - before,
                         "seconds": round(time.perf_counter() - t0, 4)})
            del out
            r = rows[-1]
            print(f"prompt {n:5d}  cache {r['cache']:6d}  captured {r['captured']}  {r['seconds'] * 1e3:9.1f} ms",
                  flush=True)
        captures, pooled = g.captures, len(g._pool)
    fresh = [r["seconds"] for r in rows if r["captured"]]
    replay = [r["seconds"] for r in rows if not r["captured"]]
    print(json.dumps({"model": args.preset or args.model, "device": str(lm.device), "prompts": len(lengths),
                      "distinct_lengths": len(set(lengths)), "cache_sizes": sorted({r["cache"] for r in rows}),
                      "captures": captures, "pooled_caches": pooled,
                      "mean_seconds_capturing": round(sum(fresh) / len(fresh), 4) if fresh else None,
                      "mean_seconds_replaying": round(sum(replay) / len(replay), 4) if replay else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
