"""Sudoku on the CPU: the shipped model in blockpress against transformers 5.23, same weights, same puzzles.

One batch of held-out puzzles per blanks level, the model's own sampler (generation_config.json: entropy
bound 0.01, at most 128 denoising steps, stable-and-confident stopping), fp32, one candidate per puzzle:

- transformers: `DiffusionGemmaForBlockDiffusion.from_pretrained(...).generate`, torch's global seed;
- blockpress, reference draws: the same global seed and draw order (the tokens must equal transformers');
- blockpress, per-row generators without and with row compaction (`compact_rows`): each puzzle draws
  from its own generator (the `solve()` / `blockpress eval` path); compaction leaves rows that stopped
  denoising out of later decoder passes, so a batch costs the sum of its rows' steps instead of
  batch x the slowest row's. The two must give the same answers.

Prints a table and ends with one JSON line.

    python3 benchmarks/bench_sudoku_cpu.py --blanks 35 45 55 --n 50 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import blockpress
from blockpress.cli.eval import puzzle_seed
from blockpress.cli.run import _int_in, _positive_int
from blockpress.tasks import sudoku as sd


def _timed(fn, repeats: int):
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0, out))
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(sd.DEFAULT_MODEL_PATH))
    p.add_argument("--blanks", type=_int_in(0, 64), nargs="+", default=[35, 45, 55])
    p.add_argument("--n", type=_positive_int, default=50, help="puzzles per level (one batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=_positive_int, default=1, help="timed runs per engine (median)")
    p.add_argument("--threads", type=_positive_int, default=None)
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip transformers")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    lm = blockpress.load(args.model, dtype="float32", progress=False)
    hf = None
    if args.reference:
        import transformers

        hf = transformers.DiffusionGemmaForBlockDiffusion.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = dict(eos_token_id=[sd.EOS_ID], pad_token_id=sd.PAD_ID)
    warm = torch.tensor([sd.encode_prompt(q) for q, _ in sd.test_set(35, 2)])  # first calls are slow: not timed
    if hf is not None:
        hf.generate(warm)
    lm.generate(warm, **eos)
    rows = []
    for b in args.blanks:
        pairs = sd.test_set(b, args.n)
        puzzles = [q for q, _ in pairs]
        ids = torch.tensor([sd.encode_prompt(q) for q in puzzles])

        def score(seqs):
            preds = [sd.decode_answer(r[ids.shape[1]:]).ljust(81, "0") for r in seqs]
            return preds, sum(sd.check(q, g, s)["solved"] for (q, s), g in zip(pairs, preds)) / len(pairs)

        def seeded(fn):
            def run():
                torch.manual_seed(args.seed)
                return fn()
            return run

        def per_row(compact):
            gens = [torch.Generator().manual_seed(puzzle_seed(args.seed, q)) for q in puzzles]
            return lm.generate(ids, generator=gens, compact_rows=compact, **eos)

        engines = []
        if hf is not None:
            engines.append(("transformers", seeded(lambda: hf.generate(ids).sequences)))
        engines += [("blockpress (reference draws)", seeded(lambda: lm.generate(ids, **eos))),
                    ("blockpress (per-row seeds)", lambda: per_row(False)),
                    ("blockpress (per-row seeds, compaction)", lambda: per_row(True))]
        seqs = {}
        for name, fn in engines:
            sec, out = _timed(fn, args.repeats)
            s = getattr(out, "sequences", out)
            seqs[name] = s
            preds, solved = score(s)
            steps = statistics.mean(out.steps_per_canvas) if hasattr(out, "steps_per_canvas") else None
            # rows the decoder ran: every row at every step of the batch, or (compaction) each row's own steps
            passes = None if steps is None else int(out.forward_passes.sum()) if "compaction" in name else len(pairs) * steps
            rows.append({"blanks": b, "engine": name, "n": len(pairs), "seconds": round(sec, 3),
                         "puzzles_per_s": round(len(pairs) / sec, 2),
                         "tok_s": round(len(pairs) * sd.CANVAS_LEN / sec, 1), "solve_rate": solved,
                         "rows_decoded": passes, "batch_steps": steps})
            print(f"{b} blanks, {name}: {sec:.2f} s, solved {100 * solved:.0f} %", flush=True)
        if hf is not None:
            same = (seqs["transformers"] == seqs["blockpress (reference draws)"]).all(-1).float().mean().item()
            rows[-3]["token_agreement_vs_transformers"] = same
        same = (seqs["blockpress (per-row seeds)"] == seqs["blockpress (per-row seeds, compaction)"]).all(-1)
        rows[-1]["same_answers_as_uncompacted"] = float(same.float().mean())
    print("\n| blanks | engine | s | puzzles/s | tok/s | solved | decoder passes | rows decoded |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['blanks']} | {r['engine']} | {r['seconds']:.2f} | {r['puzzles_per_s']:.1f} | {r['tok_s']:.0f} | "
              f"{100 * r['solve_rate']:.0f} % | {r['batch_steps'] or '-'} | {r['rows_decoded'] or '-'} |")
    print(json.dumps({"bench": "bench_sudoku_cpu", "model": args.model, "n_per": args.n, "blanks": args.blanks,
                      "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "runs": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
