"""Requests a tool would answer with no fitting tool declared (the eval's "no_call" conversations, both splits): how
many get no call, how many of those answer exactly, and how many call an undeclared tool, with other tools declared
or none. The counts of 2026-11-27-cpu-assistant.md §13:
python benchmarks/chat_probe/refusals.py MODEL [n per row, default 160]"""
import collections
import sys

import torch

import blockpress
from blockpress.parsing import parse_output
from blockpress.tasks import assistant
from blockpress.tasks.assistant import evaluate as ev

torch.set_num_threads(2)
lm = blockpress.load(sys.argv[1], progress=False)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 160
count = collections.Counter()
for seed in (assistant.VAL_SEED, assistant.HELDOUT_SEED):
    ds = [d for d in assistant.heldout(n, seed) if d.expect["kind"] == "no_call"]
    for d, c in zip(ds, ev.evaluate(lm, ds)["cases"]):
        offered = "other tools declared" if d.tools else "no tool declared"
        declared = {t["function"]["name"] for t in d.tools or []}
        calls = parse_output(c["text"]).tool_calls
        count[offered] += 1
        if not calls:
            count["no call"] += 1
            count["no call, exact answer"] += bool(c["exact"])
        else:
            count[f"called, {offered}" + ("" if all(x.name not in declared for x in calls) else " (a declared one)")] += 1
print(sys.argv[1], dict(sorted(count.items())))
