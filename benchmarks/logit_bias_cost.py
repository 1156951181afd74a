"""What a logit bias costs a denoising step: the shipped KJV model, 128 new tokens at 32 fixed steps a canvas, one
thread, each sampler with and without a bias on 293 token ids, alternating, 5 runs each.

    python benchmarks/logit_bias_cost.py

Prints ms per denoising step (the whole generation's time over its steps: a bias changes the text, so where it
ends) for each pair, then a JSON line."""

from __future__ import annotations

import json
import time

import torch

import blockpress


def main() -> None:
    torch.set_num_threads(1)
    m = blockpress.load("kjv", progress=False)
    ids = [m.tokenizer.bos_token_id] + m.tokenizer.encode("And the LORD spake unto Moses, saying,")
    kw = dict(max_new_tokens=128, max_denoising_steps=32, stability_threshold=None, confidence_threshold=None)
    bias = {i: (-1.0 if i % 2 else 0.5) for i in range(0, m.module.text.vocab_size, 7)}
    res: dict[str, list[float]] = {}
    for sampler in ("exact", "fast"):
        for _ in range(5):
            for name, b in (("none", None), ("bias", bias)):
                t = time.perf_counter()
                out = m.generate([ids], generator=torch.Generator().manual_seed(0), sampler=sampler, logit_bias=b,
                                 **kw)
                res.setdefault(f"{sampler}/{name}", []).append(
                    (time.perf_counter() - t) * 1000 / sum(out.steps_per_canvas))
    med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:11s} ms/step median {med[k]:.2f}   runs {', '.join(f'{x:.2f}' for x in v)}")
    print(json.dumps({"bench": "logit_bias_cost", "bias_ids": len(bias), "ms_per_step_median": med}))


if __name__ == "__main__":
    main()
