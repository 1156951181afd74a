"""Where a generation synchronises the host with the GPU: PyTorch's sync debug mode, each warning's blockpress frame.

A denoising step should never wait for the GPU (stop checks are batched once per canvas), so the count of sync
sites must not grow with the number of steps. This runs the same generation with 4 and 8 fixed steps on a small
random model and prints, per source line in blockpress, how many synchronising calls each made
(`tests/test_generate.py::test_fixed_steps_do_not_synchronise_on_cuda` asserts the totals are equal).

    python benchmarks/sync_sites.py                    # a CUDA GPU
    python benchmarks/sync_sites.py --sampler fast     # the fused sampler

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import warnings

import torch


def sites(fn) -> collections.Counter:
    """Runs fn under the sync debug mode ('warn'); counts warnings by their innermost blockpress frame."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found: collections.Counter = collections.Counter()
    real = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return real(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(os.path.join(root, "blockpress"))]
        where = (f"{os.path.relpath(frames[-1].filename, root)}:{frames[-1].lineno} {frames[-1].line}"
                 if frames else f"{filename}:{lineno}")
        found[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = real
    return found


def main(argv=None) -> int:
    import blockpress
    from blockpress.kernels import configure
    from blockpress.train import sizes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sampler", choices=["exact", "fast"], default="exact")
    p.add_argument("--steps", default="4,8", help="comma-separated step counts to compare")
    p.add_argument("--hf-tiny", action="store_true", help="the spec's tiny transformers model (needs transformers)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_sites.py needs a CUDA GPU (the sync debug mode only watches CUDA calls)", file=sys.stderr)
        return 2
    if args.hf_tiny:  # the spec's tiny transformers model (sliding and full layers), as the CUDA test loads it
        import tempfile

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from hf_oracle import build_hf_model

        folder = tempfile.mkdtemp(prefix="sync_sites_")
        build_hf_model().save_pretrained(folder)
        lm = blockpress.load(folder, device="cuda", dtype="bfloat16", progress=False)
    else:
        lm = blockpress.from_config(sizes.model_config("nano", vocab_size=512, canvas_length=16, context=256),
                                    device="cuda", dtype=torch.bfloat16, seed=0)
    configure(lm.module)
    x = torch.randint(5, 512, (1, 20), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(max_new_tokens=32, eos_token_id=[1], pad_token_id=0, stability_threshold=None,
              confidence_threshold=None, sampler=args.sampler)
    result = {"bench": "sync_sites", "sampler": args.sampler, "counts": {}, "sites": {}}
    for steps in [int(s) for s in args.steps.split(",")]:
        gen = lambda: lm.generate(x, generator=torch.Generator("cuda").manual_seed(0),  # noqa: E731
                                  max_denoising_steps=steps, **kw)
        gen()  # warm-up: first-use checks of the kernels, allocator growth
        found = sites(gen)
        result["counts"][steps] = sum(found.values())
        result["sites"][steps] = dict(found)
        print(f"{steps} steps: {sum(found.values())} synchronising calls")
        for where, n in found.most_common():
            print(f"  {n:4d}  {where}")
    print(json.dumps(result))
    return 0 if len(set(result["counts"].values())) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
