"""The chat model on held-out conversations: exact answers per skill, tool use, thinking; diffusion at several
denoising-step budgets against the same-size autoregressive model trained on the same data.

    python benchmarks/chat_eval.py --model assistant --steps 4 32 --ar runs/chat-ar --n 40 \
        --json benchmarks/results/chat-eval.json

The conversations are `blockpress.tasks.assistant.heldout(n)`: n per stratum (each arithmetic bucket,
conversions, dates, letters, rewrites, JSON, tool calls, answers from tool responses, no fitting tool,
follow-ups), thinking on for every other one; their questions never occur in the training data. Without
--steps the model's own sampler (generation_config.json) is evaluated; `--steps N` runs exactly N denoising
steps per canvas. Prints a markdown table (rows: metrics; columns: configurations) and ends with one JSON
line; `--json` also writes every reply.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import blockpress
from blockpress.tasks import assistant
from blockpress.tasks.assistant import evaluate as ev


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="assistant", help="diffusion checkpoint (folder, run folder or shipped name)")
    p.add_argument("--steps", type=int, nargs="*", default=[4, 32],
                   help="denoising-step budgets (early stopping off); 0 = the model's default sampler")
    p.add_argument("--ar", default=None, help="AR-baseline checkpoint (trained with --ar-only on the same data)")
    p.add_argument("--n", type=int, default=40, help="held-out conversations per stratum")
    p.add_argument("--split", choices=["test", "val"], default="test",
                   help="test: the held-out set (never trained on); val: another draw of the same strata, for "
                        "choosing sampler settings without touching the test set")
    p.add_argument("--sampler", default=None, metavar="JSON",
                   help='sampler overrides for every diffusion row, e.g. \'{"entropy_bound": 0.01}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results (and every reply) here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dialogs = assistant.heldout(args.n, assistant.HELDOUT_SEED if args.split == "test" else assistant.VAL_SEED)
    sampler = json.loads(args.sampler) if args.sampler else {}
    results, models = {}, {}
    lm = blockpress.load(args.model, progress=False)
    models["diffusion"] = str(lm.path)
    for s in args.steps:
        name = "diffusion, default sampler" if s == 0 else f"diffusion, {s} steps"
        results[name] = ev.evaluate(lm, dialogs, None if s == 0 else s, args.seed, args.batch_size, **sampler)
        print(f"{name}: {results[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    if args.ar:
        am = blockpress.load(args.ar, progress=False)
        models["ar"] = str(am.path)
        results["autoregressive (greedy)"] = ev.evaluate(am, dialogs, ar=True)
    print(f"\n{len(dialogs)} {args.split} conversations ({args.n} per stratum), "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    print(ev.format_table(results))
    summary = {name: {row: round(100 * h[0] / h[1], 1) for row, h in r["rows"].items()} for name, r in results.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models": models, "n": args.n, "split": args.split, "sampler": sampler, "seed": args.seed,
                       "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=1)
    print(json.dumps({"models": models, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
