"""The eval's 2-digit subtraction row (or another arithmetic row) on both splits, by case: a one-digit difference
or not, a borrow (carry) or not, thinking on or off. The tables of 2026-11-27-cpu-assistant.md §13:
python benchmarks/chat_probe/subtraction.py MODEL [n per row, default 160] [row, default "sub 2-digit"]"""
import collections
import re
import sys

import torch

import blockpress
from blockpress.tasks import assistant
from blockpress.tasks.assistant import evaluate as ev

torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
ck = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 160
row = sys.argv[3] if len(sys.argv) > 3 else "sub 2-digit"
lm = blockpress.load(ck, progress=False)
by, right, total = collections.defaultdict(lambda: [0, 0]), 0, 0
for seed in (assistant.VAL_SEED, assistant.HELDOUT_SEED):
    ds = [d for d in assistant.heldout(n, seed) if d.expect["row"] == row]
    for d, c in zip(ds, ev.evaluate(lm, ds)["cases"]):
        a, b, res = map(int, re.findall(r"\d+", d.messages[-1]["content"])[:3])
        regroup = a % 10 < b % 10 if "-" in row or "sub" in row else a % 10 + b % 10 >= 10
        for g in ("thinking on" if d.thinking else "thinking off", "borrow/carry" if regroup else "no borrow/carry",
                  "one-digit result" if res < 10 else "longer result"):
            by[g][0] += bool(c["exact"])
            by[g][1] += 1
        right, total = right + bool(c["exact"]), total + 1
print(ck, row, {k: f"{v[0]}/{v[1]}" for k, v in sorted(by.items())}, f"all {right}/{total}")
