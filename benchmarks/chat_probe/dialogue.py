"""Chats of several turns, as `blockpress chat` holds them: exact replies by turn.

The eval's conversations hold at most one earlier exchange, so it cannot see how a reply holds up eight turns into a
chat. Here each chat is TURNS user messages, each a small-talk phrasing (`dialogs.TALK`: greetings, thanks, questions
about the assistant, goodbyes, requests outside its skills; their one reply) or, one time in three, a one-digit sum
or product (taught: `assistant.TABLES`), sent one after the other through `cli.chat.ChatSession` (the conversation
re-rendered each turn, the cache kept), each chat with its own sampling seed. A reply counts where it is the expected
text exactly.

    python benchmarks/chat_probe/dialogue.py MODEL [--chats 30] [--turns 8]

Prints the exact share per turn and the misses, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import blockpress
from blockpress.cli.chat import ChatSession
from blockpress.tasks.assistant import dialogs, skills


def chat_plan(seed: int, turns: int) -> list[tuple[str, str]]:
    """(user message, expected reply) for each turn of chat `seed`."""
    rng = random.Random(f"dialogue-probe/{seed}")
    plan = []
    for _ in range(turns):
        if rng.random() < 1 / 3:
            it = skills.arithmetic(rng, rng.choice(["add", "mul"]), (1, 1))
            plan.append((it.question, it.answer))
        else:
            phrasings, reply, _ = dialogs.TALK[rng.choice(list(dialogs.TALK))]
            plan.append((rng.choice(phrasings), reply))
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--chats", type=int, default=30)
    ap.add_argument("--turns", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    lm = blockpress.load(args.model, progress=False)
    hits, misses, t0 = [0] * args.turns, [], time.time()
    for c in range(args.chats):
        session = ChatSession(lm, seed=c)
        for i, (q, want) in enumerate(chat_plan(c, args.turns)):
            got = session.send(q).content
            hits[i] += got == want
            if got != want:
                misses.append((c, i, q, want, got))
    for c, i, q, want, got in misses[:25]:
        print(f"  chat {c} turn {i + 1}: {q!r} -> {got!r} (want {want!r})")
    share = [h / args.chats for h in hits]
    print("turn:   " + " ".join(f"{i + 1:>5}" for i in range(args.turns)))
    print("exact:  " + " ".join(f"{100 * s:4.0f}%" for s in share))
    total = sum(hits) / (args.chats * args.turns)
    print(f"all turns: {sum(hits)} of {args.chats * args.turns} ({100 * total:.1f} %), {time.time() - t0:.0f} s")
    print(json.dumps({"probe": "dialogue", "model": args.model, "chats": args.chats, "turns": args.turns,
                      "exact_by_turn": share, "exact": total}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
