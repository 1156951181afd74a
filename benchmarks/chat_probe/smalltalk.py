"""The "small talk" row alone (greetings, questions about the assistant, thanks, goodbyes, requests outside its
skills) on a split, with the replies that missed, and the user's first messages of a new chat as typed by hand.

    python benchmarks/chat_probe/smalltalk.py MODEL [N] [--val]
"""

import sys

import torch

import blockpress
from blockpress.tasks.assistant import HELDOUT_SEED, VAL_SEED, heldout, strata
from blockpress.tasks.assistant.evaluate import evaluate

FIRST = ["Hi", "Hello", "Hello!", "hi there", "Who are you?", "What can you do?", "Thanks!", "Tell me a joke.",
         "How are you?", "Bye"]

if __name__ == "__main__":
    torch.set_num_threads(1)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model, n = args[0], int(args[1]) if len(args) > 1 else 160
    lm = blockpress.load(model, progress=False)
    s = len(strata()) - 1  # the small-talk stratum is the last
    dialogs = heldout(n, VAL_SEED if "--val" in sys.argv else HELDOUT_SEED)[s * n:(s + 1) * n]
    res = evaluate(lm, dialogs)
    hits, total = res["rows"]["small talk"]
    for d, c in zip(dialogs, res["cases"]):
        if not c["exact"]:
            print(f"  miss: {d.messages[-2]['content']!r} -> {c['text'][:90]!r}")
    for q in FIRST:
        print(f"  {q!r} -> {lm.chat(q, seed=0).content!r}")
    print(f"small talk: {hits} of {total} ({100 * hits / total:.1f} %), {res['seconds']:.0f} s")
