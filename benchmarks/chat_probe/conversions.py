"""The eval's conversion row on the validation split, by factor, by direction (up: × factor, down: ÷ factor), by
thinking mode, and for the factors 7/12/24/60 by whether the question is one of the test split's (kept out of every
training mix: "unseen") or may have been a training question ("may be seen"; `prepare_chat.py --holdout-val` mixes
keep these out too). The tables of 2026-11-27-cpu-assistant.md §7 and §8:
python benchmarks/chat_probe/conversions.py MODEL [n per row, default 80] [--test: the test split instead]"""
import sys, torch, collections
import blockpress
from blockpress.tasks import assistant
from blockpress.tasks.assistant import evaluate as ev, skills
torch.set_num_threads(1)
test = "--test" in sys.argv
args = [a for a in sys.argv[1:] if a != "--test"]
ck = args[0]; n = int(args[1]) if len(args) > 1 else 80
lm = blockpress.load(ck, progress=False)
unseen = assistant.heldout_keys()
ds = [d for d in assistant.heldout(n, assistant.HELDOUT_SEED if test else assistant.VAL_SEED)
      if d.expect["row"] == "conversion"]
r = ev.evaluate(lm, ds)
by = collections.defaultdict(lambda: [0, 0])
for d, c in zip(ds, r["cases"]):
    key = [k for k in d.keys if k[0] == "conv"][0]
    f = skills.CONVERSIONS[key[1]][4]
    think = "think" if d.thinking else "no-think"
    groups = [f"x{f}" if f in assistant.CONVERSION_FACTORS else "x10^k", think]
    if f in assistant.CONVERSION_FACTORS:
        groups += [f"7/12/24/60 {'down' if key[2] else 'up'} {think}",
                   f"7/12/24/60 {'unseen' if key in unseen else 'may be seen'}"]
    for g in groups:
        by[g][0] += bool(c["exact"]); by[g][1] += 1
print(ck, {k: f"{v[0]}/{v[1]}" for k, v in sorted(by.items())}, f"all {100*sum(bool(c['exact']) for c in r['cases'])/len(ds):.1f}%")
