"""Sudoku: block diffusion at several denoising-step budgets vs the autoregressive baseline.

Both models share the architecture, size, training data stream and step count (scripts/train_sudoku.py;
the AR model is the same backbone trained with the encoder next-token loss only, decoded greedily).
Evaluates the held-out `sudoku.test_set` puzzles per number of blanks; prints a markdown table, writes
a PNG (solve rate and blank-cell accuracy vs denoising steps, AR as a line) and ends with one JSON line.

    python3 benchmarks/sudoku_ar_vs_diffusion.py --diffusion runs/sudoku-diffusion/checkpoint-XXXX \
        --ar runs/sudoku-ar/checkpoint-XXXX --n 20 --steps 1 2 4 8 16 32 --png benchmarks/results/sudoku_ar_vs_diffusion.png
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import blockpress
from blockpress.cli.eval import run_eval
from blockpress.cli.run import _int_in, _nonneg_int, _positive_int
from blockpress.tasks import sudoku as sd


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--diffusion", default=str(sd.DEFAULT_MODEL_PATH), help="diffusion checkpoint folder")
    p.add_argument("--ar", default=None, help="AR-baseline checkpoint folder (trained with --ar-only)")
    p.add_argument("--ar-results", default=None, metavar="JSON",
                   help="instead of --ar: the AR baseline's saved `blockpress eval sudoku --ar --json` file (its "
                        "predictions are re-scored here; it must cover --n and --blanks)")
    p.add_argument("--n", type=_positive_int, default=20, help="puzzles per blanks level")
    p.add_argument("--blanks", type=_int_in(0, 64), nargs="+", default=[35, 45, 55])
    p.add_argument("--steps", type=_positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--samples", type=_positive_int, default=None, metavar="K",
                   help="also evaluate the default sampler with up to K candidates per puzzle, the one that breaks "
                        "no rule kept (default: the model's own, blockpress_task.json; the other diffusion rows "
                        "draw one candidate, as the greedy AR model gives one answer)")
    p.add_argument("--repair", type=_nonneg_int, default=0, metavar="R",
                   help="also evaluate the default sampler with up to R repair rounds (editing in place)")
    p.add_argument("--threads", type=_positive_int, default=None)
    p.add_argument("--png", default=None, help="also draw the table as a plot here (the shipped one: "
                   "benchmarks/results/sudoku_ar_vs_diffusion.png)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the final JSON line's summary here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    saved_ar = _saved_ar(args.ar_results, args.n, args.blanks) if args.ar_results and not args.ar else None
    rows = []  # (name, steps or None, results)
    dm = blockpress.load(args.diffusion, progress=False)
    t0 = time.perf_counter()
    adaptive = dm.generation_defaults.get("max_denoising_steps")
    for name, res in run_eval(dm, args.n, args.blanks, args.steps, samples=1).items():
        rows.append(("diffusion", int(name.split("=")[1].split("+")[0]), res))
    for name, res in run_eval(dm, args.n, args.blanks, samples=1).items():
        rows.append(("diffusion (adaptive)", adaptive, res))
    k = args.samples or sd.default_samples(dm)
    if k > 1:
        for name, res in run_eval(dm, args.n, args.blanks, samples=k).items():
            rows.append((f"diffusion (adaptive, up to {k} candidates)", adaptive, res))
    if args.repair:
        for name, res in run_eval(dm, args.n, args.blanks, repair=args.repair, samples=1).items():
            rows.append((f"diffusion (adaptive + {args.repair} repair rounds)",
                         dm.generation_defaults.get("max_denoising_steps"), res))
    if args.ar:
        am = blockpress.load(args.ar, progress=False)
        rows.append(("autoregressive (greedy)", sd.N_CELLS, run_eval(am, args.n, args.blanks, ar=True)["ar"]))
    elif saved_ar is not None:
        rows.append(("autoregressive (greedy)", sd.N_CELLS, saved_ar))
    wall = time.perf_counter() - t0

    hdr = "| model | steps | " + " | ".join(f"solved@{b}" for b in args.blanks) + \
          " | solved | cell acc | clues kept | s |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for name, steps, res in rows:
        per = " | ".join(f"{100 * res['per_blanks'][b]['solve_rate']:.0f}%" for b in args.blanks)
        o = res["overall"]
        print(f"| {name} | {steps} | {per} | {100 * o['solve_rate']:.1f}% | {100 * o['cell_accuracy']:.1f}% | "
              f"{100 * o['clues_kept']:.1f}% | {o['seconds']:.1f} |")
    if args.png:
        _plot(rows, args.png)
    summary = {"bench": "sudoku_ar_vs_diffusion", "n_per": args.n, "blanks": args.blanks,
               "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "wall_s": round(wall, 1),
               "results": [{"model": n, "steps": s, **{k: round(v, 4) for k, v in r["overall"].items()}}
                           for n, s, r in rows]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


def _saved_ar(path, n, blanks) -> dict:
    """A saved AR eval, re-scored from its predictions on the same held-out puzzles (first n per level)."""
    saved = json.load(open(path))["ar"]["per_blanks"]  # checked before any model runs
    missing = [b for b in blanks if len(saved.get(str(b), {}).get("predictions", [])) < n]
    if missing:
        raise SystemExit(f"{path} has fewer than {n} AR predictions at blanks {missing}; re-run the AR eval")
    preds = {b: saved[str(b)]["predictions"][:n] for b in blanks}
    res = sd.evaluate(lambda puzzles: preds[puzzles[0].count("0")], blanks, n)  # one call per level
    for b in blanks:
        res["per_blanks"][b]["seconds"] = saved[str(b)]["seconds"] * n / saved[str(b)]["n"]
    res["overall"]["seconds"] = sum(res["per_blanks"][b]["seconds"] for b in blanks)
    return res


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diff = [(s, r["overall"]) for n, s, r in rows if n == "diffusion"]
    ar = [r["overall"] for n, _, r in rows if n.startswith("autoregressive")]
    extra = [(n, r["overall"]) for n, _, r in rows if n.startswith("diffusion (")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "solve_rate", "puzzles solved"), (axes[1], "cell_accuracy", "blank-cell accuracy")):
        ax.plot([s for s, _ in diff], [100 * o[key] for _, o in diff], "o-", label="block diffusion")
        if ar:
            ax.axhline(100 * ar[0][key], color="C3", ls="--", label="autoregressive (81 steps)")
        for k, (name, o) in enumerate(extra):
            ax.axhline(100 * o[key], color=f"C{k + 1}", ls=":", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("denoising steps (fixed)")
        ax.set_ylabel(f"{label} (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("9x9 Sudoku, held-out puzzles, same backbone and size: block diffusion vs autoregressive")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
