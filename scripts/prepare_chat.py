"""Data and tokenizer for the shipped chat model (blockpress/assets/assistant): generated conversations.

    python scripts/prepare_chat.py --out runs/chat

Writes, under --out:
  train.jsonl      --n generated conversations (`blockpress train` chat rows: messages, tools,
                   enable_thinking; the final assistant turn is supervised), none using a test question
                   (nor, with --holdout-val, a validation one; with --teach-tables, one-digit sums and
                   products may be): the normal stream with --drill of them drills
                   (--drills: broad, goals, conversions, factors, wide, products, tables, tables-tools,
                   subtraction, refusals or sub-refusals;
                   conversion and subtraction workings as --conversion-working and --sub-working write
                   them)
                   (`assistant.drilled_dialogs(--n, --mix-seed, --drill, exclude, drills=--drills)`)
  heldout.jsonl    the eval set (`blockpress.tasks.assistant.heldout`, --heldout per table row), each row
                   with its `expect` (what a right reply does); the trainer reads it for the eval loss
  tokenizer/       tokenizer.json (byte-level BPE, --vocab ids, every Gemma 4 special token, digits one per
                   token; learned on --tokenizer-rows of the normal stream,
                   `assistant.train_dialogs(--tokenizer-rows, --seed)`), tokenizer_config.json, chat_template.jinja (the
                   repository's Gemma 4 template)

Then train: scripts/train_chat.py (the recipe of the shipped model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    from blockpress.tasks.assistant import DRILLS, dialogs, skills

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/chat")
    ap.add_argument("--n", type=int, default=160_000, help="training conversations")
    ap.add_argument("--drill", type=float, default=0.45, help="share of arithmetic / conversion drills")
    ap.add_argument("--drills", default="broad", choices=list(DRILLS),
                    help="what the drills ask: broad (arithmetic of every size, conversions), goals (2-digit "
                         "addition / subtraction, conversions, tool calls: the eval's goal rows) or conversions "
                         "(the goal rows, conversions weighted up, and products by the factors 7, 12, 24, 60) or "
                         "factors (the goal rows, conversions by 7, 12, 24 and 60 weighted up) or wide (factors, with "
                         "those conversions' multipliers up to 99, not 30) or products (wide, three times as dense "
                         "in them) or tables (goals, a fifth of the drills one-digit sums and products: use it with "
                         "--teach-tables) or tables-tools (tables, and requests no tool fits and answers from a "
                         "tool's response) or subtraction (tables-tools, 2-digit subtraction weighted up, one-digit "
                         "differences most) or refusals (requests no declared tool fits, with other tools declared, "
                         "and calls) or sub-refusals (subtraction with less subtraction, and refusals' undeclared tools)")
    ap.add_argument("--sub-working", default="columns", choices=skills.SUB_WORKINGS,
                    help="how the training conversations' subtraction workings end where the difference is shorter "
                         "than the first number (blockpress.tasks.assistant.skills.SUB_WORKING; the tokenizer's "
                         "rows keep columns)")
    ap.add_argument("--conversion-working", default="product", choices=skills.CONVERSION_WORKINGS,
                    help="how the training conversations' conversion workings by 7, 12, 24 and 60 are written "
                         "(blockpress.tasks.assistant.skills.CONVERSION_WORKING; the tokenizer's rows keep product)")
    ap.add_argument("--holdout-val", action="store_true",
                    help="also keep the validation split's questions out of the mix, so that `eval --split val` "
                         "measures unseen questions (a conversion fact seen in training is recalled, not computed)")
    ap.add_argument("--teach-tables", action="store_true",
                    help="leave the one-digit sums and products (assistant.TABLES) in the mix although the held-out "
                         "set asks most of them: a model trained on it has been taught its tables, and the eval's "
                         "\"add 1-digit\" and \"mul 1x1-digit\" rows measure recall")
    ap.add_argument("--history", type=int, default=1,
                    help="the most earlier exchanges a training conversation opens with (blockpress.tasks.assistant."
                         "dialogs.HISTORY; 1: one, in a quarter of them, as every stage before 29)")
    ap.add_argument("--mix-seed", type=int, default=4, help="seed of the training conversations")
    ap.add_argument("--tokenizer-rows", type=int, default=120_000, help="conversations the BPE is learned on")
    ap.add_argument("--heldout", type=int, default=40, help="held-out conversations per table row")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0, help="seed of the conversations the BPE is learned on")
    args = ap.parse_args(argv)
    if args.history < 1:
        ap.error(f"--history must be 1 or more (earlier exchanges a conversation may open with), got {args.history}")

    from blockpress.chat import DEFAULT_GEMMA4_TEMPLATE, render_chat_template
    from blockpress.tasks import assistant
    from blockpress.tasks.assistant.tokenizer import train_tokenizer
    from blockpress.tokenizer import Tokenizer
    from blockpress.train.data import assistant_turn_text, chat_example

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    working = skills.CONVERSION_WORKING.set(args.conversion_working)  # the mix and the eval-loss rows
    sub_working = skills.SUB_WORKING.set(args.sub_working)
    held = assistant.heldout(args.heldout)
    history = dialogs.HISTORY.set(args.history)  # the mix only
    with open(out / "train.jsonl", "w") as f:
        exclude = assistant.mix_exclude(val=args.holdout_val, tables=args.teach_tables)
        for d in assistant.drilled_dialogs(args.n, args.mix_seed, args.drill, exclude, drills=args.drills):
            f.write(json.dumps(d.row(), ensure_ascii=False) + "\n")
    dialogs.HISTORY.reset(history)
    skills.CONVERSION_WORKING.reset(working)
    skills.SUB_WORKING.reset(sub_working)
    rows = [d.row() for d in assistant.train_dialogs(args.tokenizer_rows, args.seed)]
    with open(out / "heldout.jsonl", "w") as f:
        for d in held:
            f.write(json.dumps({**d.row(), "expect": d.expect}, ensure_ascii=False) + "\n")

    def texts():  # what the model reads: the prompt as rendered at inference + the supervised turn
        for r in rows:
            yield render_chat_template(DEFAULT_GEMMA4_TEMPLATE, r["messages"][:-1], add_generation_prompt=True,
                                       enable_thinking=r.get("enable_thinking", False), tools=r.get("tools"))
            yield assistant_turn_text(DEFAULT_GEMMA4_TEMPLATE, r["messages"][-1], r.get("enable_thinking", False))

    train_tokenizer(texts(), args.vocab, out / "tokenizer")
    tok = Tokenizer.from_dir(out / "tokenizer")
    lens = [(len(p), len(r)) for p, r in (chat_example(tok, r) for r in rows[:2000])]
    prompt, resp = sorted(p for p, _ in lens), sorted(r for _, r in lens)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    print(f"{args.n} training conversations + {len(held)} held out; vocab {tok.vocab_size}; "
          f"prompt tokens median {pct(prompt, .5)} / p99 {pct(prompt, .99)} / max {prompt[-1]}, "
          f"response tokens median {pct(resp, .5)} / p99 {pct(resp, .99)} / max {resp[-1]} (first 2000); "
          f"written to {out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
