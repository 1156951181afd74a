"""The one-digit tables: all 100 sums a + b and 100 products a × b (a, b < 10), one held-out-style conversation
each, split by whether the fact is one of the held-out set's questions (`assistant.heldout_keys()`, what a mix
without --teach-tables leaves out) and by thinking mode. 2026-11-27-cpu-assistant.md §12.
python benchmarks/chat_probe/tables.py MODEL [threads]"""
import collections
import random
import sys

import torch

import blockpress
from blockpress.tasks import assistant
from blockpress.tasks.assistant import dialogs, evaluate as ev, skills

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
lm = blockpress.load(sys.argv[1], progress=False)
held = assistant.heldout_keys()
ds, groups = [], []
for op in ("add", "mul"):
    for a in range(10):
        for b in range(10):
            rng = random.Random(f"facts/{op}/{a}/{b}")
            ds.append(dialogs.conversation(rng, "skill", skills.arithmetic_item(op, a, b, rng)))
            groups.append((op, ("arith", op, a, b) in held, ds[-1].thinking))
r = ev.evaluate(lm, ds)
by = collections.defaultdict(lambda: [0, 0])
for (op, is_held, think), c in zip(groups, r["cases"]):
    for k in (f"{op} {'held out' if is_held else 'trainable'}", f"{op} {'thinking' if think else 'no thinking'}"):
        by[k][0] += bool(c["exact"])
        by[k][1] += 1
print(sys.argv[1], {k: f"{v[0]}/{v[1]}" for k, v in sorted(by.items())})
