"""Sudoku: solve rate and time against the number of candidates per puzzle (`solve(..., samples=K)`).

Candidate 0 of a puzzle is the one-candidate pass; candidates 1..K-1 are drawn only for puzzles whose
first candidate breaks a rule, each from its own seeded generator, and the answer is the first candidate
that breaks no rule (else the one breaking the fewest cells). The rules are checked, never the solution.
Because candidate j of a puzzle is the same whatever K is, one run with the largest K gives every
smaller K as a prefix: this script draws up to max(--samples) candidates per puzzle once and scores each
K from them. Time per K is the first pass plus the share of the extra passes that K uses.

Run on the validation split (the default) to choose the shipped default; the test split is for the
published numbers (`blockpress eval sudoku`). Prints a markdown table and ends with one JSON line.

    python3 benchmarks/sudoku_samples.py --split val --n 40 --samples 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import blockpress
from blockpress.cli.eval import puzzle_seed
from blockpress.cli.run import _int_in, _positive_int
from blockpress.tasks import sudoku as sd


def candidates(lm, puzzles: list[str], k_max: int, seed: int = 0, batch_size: int = 50, **sampling):
    """Per puzzle: its candidate grids (1 if the first breaks no rule, else k_max), and seconds spent on
    the first pass and per extra candidate (the extra passes' time split evenly over their rows)."""
    gens = [torch.Generator(device=lm.device).manual_seed(puzzle_seed(seed, p)) for p in puzzles]
    t0 = time.perf_counter()
    first = []
    for i in range(0, len(puzzles), batch_size):
        first += sd.solve_batch(puzzles[i:i + batch_size], lm, samples=1, generator=gens[i:i + batch_size], **sampling)
    t_first = time.perf_counter() - t0
    out = [[g] for g in first]
    todo = [i for i, (p, g) in enumerate(zip(puzzles, first)) if sd.broken_cells(p, g, "cells")]
    rows = [(i, j) for i in todo for j in range(1, k_max)]
    t0 = time.perf_counter()
    for r in range(0, len(rows), batch_size):
        chunk = rows[r:r + batch_size]
        gen = [sd._candidate_generator(gens[i], j) for i, j in chunk]
        preds = sd.solve_batch([puzzles[i] for i, _ in chunk], lm, samples=1, generator=gen, **sampling)
        for (i, _), g in zip(chunk, preds):
            out[i].append(g)
    t_extra = (time.perf_counter() - t0) / max(1, len(rows))
    return out, t_first, t_extra


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(sd.DEFAULT_MODEL_PATH))
    p.add_argument("--split", choices=sorted(sd.SPLITS), default="val")
    p.add_argument("--n", type=_positive_int, default=40, help="puzzles per blanks level")
    p.add_argument("--blanks", type=_int_in(0, 64), nargs="+", default=list(sd.EVAL_BLANKS))
    p.add_argument("--samples", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="candidate counts K to score")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive_int, default=None)
    p.add_argument("--json", default=None, help="also write the per-level results here")
    args = p.parse_args(argv)
    if min(args.samples) < 1 or args.n < 1:
        p.error("--samples and --n must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = blockpress.load(args.model, progress=False)
    ks = sorted(set(args.samples))
    table = {k: {} for k in ks}
    for b in args.blanks:
        pairs = sd.test_set(b, args.n, sd.SPLITS[args.split])
        puzzles = [q for q, _ in pairs]
        cands, t_first, t_extra = candidates(lm, puzzles, ks[-1], args.seed)
        for k in ks:
            picked = [sd.pick_candidate(q, c[:k]) for q, c in zip(puzzles, cands)]
            solved = sum(sd.check(q, g, s)["solved"] for (q, s), g in zip(pairs, picked))
            extra = sum(min(k, len(c)) - 1 for c in cands)
            table[k][b] = {"solved": solved, "n": len(pairs), "seconds": t_first + extra * t_extra}
        print(f"{b} blanks: " + ", ".join(f"K={k} {table[k][b]['solved']}/{len(pairs)}" for k in ks), flush=True)
    hdr = "| K | " + " | ".join(f"{b} blanks" for b in args.blanks) + " | all | s per puzzle |"
    print("\n" + hdr + "\n|" + "---:|" * (hdr.count("|") - 1))
    summary = []
    for k in ks:
        solved = sum(r["solved"] for r in table[k].values())
        n = sum(r["n"] for r in table[k].values())
        sec = sum(r["seconds"] for r in table[k].values())
        cells = " | ".join(f"{100 * table[k][b]['solved'] / table[k][b]['n']:.1f} %" for b in args.blanks)
        print(f"| {k} | {cells} | {100 * solved / n:.1f} % | {sec / n:.2f} |")
        summary.append({"samples": k, "solve_rate": round(solved / n, 4), "seconds_per_puzzle": round(sec / n, 3),
                        "per_blanks": {str(b): table[k][b]["solved"] / table[k][b]["n"] for b in args.blanks}})
    line = {"bench": "sudoku_samples", "model": args.model, "split": args.split, "n_per": args.n,
            "blanks": args.blanks, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "results": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(line, f, indent=2)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
