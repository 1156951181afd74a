"""`blockpress eval sudoku|infill|chat`: task evals of a model.

`chat`: the chat model (default: the shipped `assistant`) on held-out generated conversations
(`blockpress.tasks.assistant.heldout(--n)`: --n per stratum: each arithmetic bucket, conversions, dates,
letters, rewrites, JSON, tool calls, answers from tool responses, no fitting tool, follow-ups; thinking on
for every other one; their questions never occur in the training data). One table: exact answers per
skill, tool calls with schema-valid arguments, no call when no tool fits, answers that use the tool's
response, thinking on/off well-formed; a column for the model's own sampler and one per `--steps N`
(exactly N denoising steps per canvas), and `--compare-ar DIR` adds the same-size autoregressive model
trained on the same data (greedy). Ends with one JSON line.

`--entropy-bound`, `--t-min` and `--t-max` replace the model's own sampler settings in every diffusion column
(compare settings on `--split val`). The shipped chat model's training data kept out only the test split's
questions, so a validation question may be one it was trained on: a conversion fact it recalls scores there
although it cannot compute it. Mixes made with `scripts/prepare_chat.py --holdout-val` keep both out.

`infill`: hide one word of each held-out passage (--data, default the shipped text model's
eval/heldout.txt) and fill it with and without the text after it (blockpress/tasks/text_infill.py).

`sudoku`: solve rate, cell accuracy and clue preservation per number of blanks.

Evaluates the held-out puzzles of `blockpress.tasks.sudoku.test_set` (never trained on). `--steps 1 4 16`
evaluates each denoising-step budget with early stopping disabled (fixed N steps); without `--steps` the
model's generation_config.json defaults are used. Each puzzle samples from its own generator seeded by
(--seed, puzzle), so a result does not depend on the batch size, and `--n 3` gives exactly the first
three predictions of `--n 50` (the held-out sets are prefixes of each other): CI checks the published
numbers that way. `--repair R` adds up to R rounds of editing in place (`solve_batch(repair=R)`): each
round re-denoises the cells that break a Sudoku rule and holds the rest. Repair rounds batch only the
broken puzzles, and CPU matmuls differ by ~1e-7 between batch shapes, so after a repair round a
near-tied draw can differ with --n or --batch-size (the first pass does not). `--samples K` denoises K
candidates per puzzle side by side and keeps the one that breaks no rule, else the fewest cells
(`solve_batch(samples=K)`; without the flag: the model's blockpress_task.json "samples", else 1; with it
the results are named e.g. "default+samples=K"). `--ar` evaluates the model as a causal LM (greedy),
the autoregressive baseline. `--split val` evaluates the validation split instead (seed
"blockpress-sudoku-val", the same generator): make choices there (sampler settings, which checkpoint to
ship) and report the test split. `--json FILE` writes all results.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..config import fixed_steps
from ..errors import InputError
from ..options import DTYPE_NAMES
from .run import (MAX_STEPS, _int_in, _nonneg_int, _output_file, _positive_int, _seed, _steps,
                  add_fp8_activations_arg, add_sampler_args, add_storage_args, experts_option, sampler_kwargs,
                  storage_options)


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", choices=["sudoku", "infill", "chat"], help="task to evaluate")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model for the task)")
    p.add_argument("--data", default=None, help="infill: passages separated by blank lines")
    p.add_argument("--adapter", default=None, help="LoRA adapter folder to apply")
    p.add_argument("--n", type=_positive_int, default=None,
                   help="sudoku: puzzles per blanks level (default 50); infill: passages (default 200); chat: "
                        "conversations per stratum (default 40)")
    p.add_argument("--blanks", type=_int_in(0, 64), nargs="+", default=None,
                   help="blanks levels, 0..64 (a unique puzzle keeps >= 17 clues; default 35 40 45 50 55)")
    p.add_argument("--steps", type=_steps, nargs="+", default=None, metavar="N",
                   help=f"fixed denoising-step budgets to compare (1..{MAX_STEPS} each)")
    add_sampler_args(p.add_argument_group("sampler (default: the model's generation_config.json)"))
    p.add_argument("--batch-size", type=_positive_int, default=50)
    p.add_argument("--seed", type=_seed, default=0, help="sampling seed")
    p.add_argument("--repair", type=_nonneg_int, default=0, metavar="R",
                   help="sudoku: up to R rounds of re-denoising the cells that break a rule, the rest of the "
                        "canvas held (edited in place; uses the rules, never the solution). Default 0")
    p.add_argument("--samples", type=_positive_int, default=None, metavar="K",
                   help="sudoku: candidates per puzzle denoised side by side, the one that breaks no rule kept "
                        "(uses the rules, never the solution). Default: the model's own (blockpress_task.json)")
    p.add_argument("--ar", action="store_true", help="greedy autoregressive decoding (AR baseline model)")
    p.add_argument("--compare-ar", default=None, metavar="DIR",
                   help="chat: add this AR baseline (trained with --ar-only on the same data) as a column")
    p.add_argument("--no-compact-rows", action="store_true",
                   help="keep puzzles that stopped denoising in every decoder pass of their batch (the reference "
                        "loop; same answers, slower: for timing compaction)")
    p.add_argument("--split", choices=["test", "val"], default="test",
                   help="sudoku and chat: the held-out test set (default) or the validation split, for choosing "
                        "settings and checkpoints without touching the test set")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                   help="weights dtype (default: float32 on CPU, the checkpoint's dtype on GPU)")
    add_storage_args(p)  # (judge a format by the task)
    add_fp8_activations_arg(p)
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N", help="torch CPU threads")
    p.add_argument("--json", default=None, type=_output_file, help="write the results here")


def run_eval(lm, n: int, blanks, steps=None, batch_size: int = 50, seed: int = 0, ar: bool = False,
             repair: int = 0, split: str = "test", samples: int | None = None, compact_rows: bool = True,
             **sampling) -> dict:
    import torch

    from blockpress.errors import InputError
    from blockpress.tasks import sudoku as sd

    if repair < 0:
        raise InputError(f"--repair must be >= 0 rounds, got {repair}")
    if samples is not None and samples < 1:
        raise InputError(f"--samples must be >= 1 candidate per puzzle, got {samples}")
    blanks = tuple(dict.fromkeys(blanks or sd.EVAL_BLANKS))  # a level given twice is one level (it counted twice)
    puzzles_seed = sd.SPLITS[split]
    if ar:
        if repair:
            raise InputError("--repair edits a diffusion canvas in place; an AR model (--ar) cannot")
        if samples not in (None, 1):
            raise InputError("--samples draws several diffusion canvases per puzzle; the greedy AR baseline (--ar) "
                             "has one answer")
        from blockpress.train.ar import sudoku_solver

        return {"ar": sd.evaluate(_batched(sudoku_solver(lm), batch_size), blanks, n, puzzles_seed)}
    out = {}
    for s in steps or [None]:
        kw = _budget(sampling, s)

        def solve(puzzles, kw=kw):  # one generator per puzzle: the first pass does not depend on batching or n
            gens = [torch.Generator(device=lm.device).manual_seed(puzzle_seed(seed, p)) for p in puzzles]
            return sd.solve_batch(puzzles, lm, generator=gens, samples=samples, repair=repair,
                                  compact_rows=compact_rows, **kw)
        name = "+".join([("default" if s is None else f"steps={s}")] + ([f"samples={samples}"] if samples else [])
                        + ([f"repair={repair}"] if repair else []))
        out[name] = sd.evaluate(_batched(solve, batch_size), blanks, n, puzzles_seed)
    return out


def _budget(sampling: dict, steps: int | None) -> dict:
    """The generation settings of one eval column: `sampling`, and exactly `steps` steps per canvas (early stopping
    off) when given."""
    return dict(sampling) if steps is None else {**sampling, **fixed_steps(steps)}


def puzzle_seed(seed: int, puzzle: str) -> int:
    """The sampling seed of one puzzle in an eval: a function of (seed, puzzle) alone."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}/{puzzle}".encode(), digest_size=8).digest(), "little") >> 1


def _batched(fn, bs):
    def run(puzzles):
        preds = []
        for i in range(0, len(puzzles), bs):
            preds += list(fn(puzzles[i:i + bs]))
        return preds
    return run


def main(args) -> int:
    import torch

    import blockpress
    from blockpress.tasks import sudoku as sd

    if args.threads:
        from .threads import set_threads

        set_threads(args.threads)
    # flags of one task given to another were ignored: the numbers would not be what was asked for
    only = {"sudoku": {"blanks": None, "repair": 0, "samples": None, "no_compact_rows": False},
            "chat": {"compare_ar": None}, "infill": {"data": None}}
    given = [f"--{k.replace('_', '-')} ({task})" for task, flags in only.items() if task != args.task
             for k, default in flags.items() if getattr(args, k) != default]
    if args.task == "infill" and (args.ar or args.split != "test"):
        given += ["--ar (sudoku, chat)"] * args.ar + ["--split (sudoku, chat)"] * (args.split != "test")
    if given:
        raise InputError(f"{', '.join(given)}: not a flag of `blockpress eval {args.task}`; drop it")
    if args.task == "infill":
        return _infill(args)
    if args.task == "chat":
        return _chat(args)
    path = args.model or sd.DEFAULT_MODEL_PATH
    if args.model is None and not (sd.DEFAULT_MODEL_PATH / "config.json").is_file():
        raise sd.SudokuModelMissing(f"no sudoku model at {path}; pass --model DIR")
    lm = blockpress.load(path, device=args.device, dtype=args.dtype, progress=False,
                         **storage_options(args), **experts_option(args))
    sd.require_sudoku_model(lm, path)
    _adapter(lm, args)
    results = run_eval(lm, args.n or 50, args.blanks, args.steps, args.batch_size, args.seed, args.ar, args.repair,
                       args.split, args.samples, not args.no_compact_rows, **sampler_kwargs(args))
    for name, res in results.items():
        print(f"\n{name} ({path}, {args.split} split)")
        print(sd.format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in results.items()}, f, indent=2)
    return 0


def _adapter(lm, args):
    """The model evaluated: `lm` with `--adapter` applied (every task's; one line naming a bad folder)."""
    if args.adapter:
        from blockpress.train.lora import apply_adapter

        apply_adapter(lm, args.adapter)
    return lm


def _infill(args) -> int:
    from pathlib import Path

    import blockpress
    from blockpress.errors import InputError
    from blockpress.tasks import text_infill as ti

    from blockpress.loading import SHIPPED_MODELS, resolve_path

    from .run import refuse_task_model

    def passages(data: Path) -> list[str]:
        if not data.exists():
            raise InputError(f"no passages at {data}; pass --data FILE (passages separated by blank lines)")
        return ti.read_passages(data)  # a folder, or text that is not UTF-8: one line naming it

    if args.data:  # a typo in --data fails before the model loads
        passages(Path(args.data))
    path = resolve_path(args.model, progress=False) if args.model else SHIPPED_MODELS["kjv"]
    lm = blockpress.load(path, device=args.device, dtype=args.dtype, progress=False,
                         **storage_options(args), **experts_option(args))
    refuse_task_model(lm, "eval infill")
    source = Path(args.data) if args.data else path / "eval" / "heldout.txt"
    data = passages(source)
    _adapter(lm, args)
    examples = ti.make_examples(data, args.n or 200, args.seed)
    results = {}
    sampling = sampler_kwargs(args)
    for s in args.steps or [None]:
        kw = _budget(sampling, s)
        name = "default" if s is None else f"steps={s}"
        results[name] = res = ti.evaluate(lm, examples, args.seed, **kw)
        print(f"\n{name} ({path}, {len(examples)} passages of {source}, {res['seconds']:.0f} s)")
        print(ti.format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps({name: r["summary"] for name, r in results.items()}))
    return 0


def _chat(args) -> int:
    import platform

    import torch

    import blockpress
    from blockpress.loading import DEFAULT_CHAT_MODEL
    from blockpress.tasks import assistant
    from blockpress.tasks.assistant import evaluate as ev

    from .run import refuse_task_model

    def load(path):
        from blockpress.errors import InputError

        lm = blockpress.load(path, device=args.device, dtype=args.dtype, progress=False,
                             **storage_options(args), **experts_option(args))
        refuse_task_model(lm, "eval chat")
        if lm.tokenizer is None or not lm.tokenizer.is_chat:  # (it printed a table of a text model's noise)
            raise InputError(f"{lm.path} is a plain text model (no chat template): `eval chat` scores chat replies; "
                             "give a chat model (--model, default the shipped assistant)")
        return lm

    lm = _adapter(load(args.model or DEFAULT_CHAT_MODEL), args)  # (it was not applied: the base model's table)
    dialogs = assistant.heldout(args.n or 40, assistant.HELDOUT_SEED if args.split == "test" else assistant.VAL_SEED)
    results = {}
    if args.ar:
        results["autoregressive (greedy)"] = ev.evaluate(lm, dialogs, ar=True)
    else:
        given = sampler_kwargs(args)  # the column names say what differs from the checkpoint's sampler
        what = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in given.items())
        for s in [None] + list(args.steps or []):
            name = ("diffusion, " + ", ".join(x for x in ("default sampler" if s is None and not what else "",
                                                          f"{s} steps" if s is not None else "", what) if x))
            results[name] = ev.evaluate(lm, dialogs, s, args.seed, args.batch_size, **given)
            print(f"{name}: {results[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    if args.compare_ar:
        results["autoregressive (greedy)"] = ev.evaluate(load(args.compare_ar), dialogs, ar=True)
    print(f"\n{len(dialogs)} {args.split} conversations ({args.n or 40} per stratum) of {lm.path}, "
          f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
    print(ev.format_table(results))
    for r in results.values():  # per row, % of its cases: what the table shows
        r["summary"] = {row: round(100 * h[0] / h[1], 1) for row, h in r["rows"].items()}
    if args.json:  # as the other tasks write it: {column: {summary, rows, cases, seconds}}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps({name: r["summary"] for name, r in results.items()}))
    return 0
