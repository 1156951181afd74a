"""Conversions by 7, 12, 24 and 60 alone, thinking off (user question, assistant answer): can the model family
compute them for multipliers it never saw? Training rows leave out every question of the test split
(`assistant.heldout_keys()`); the held-out file is those questions, one row each.
python benchmarks/chat_probe/make_conv.py N OUT SEED MAX_K   # MAX_K 30: the chat world's multipliers; 99: denser
python benchmarks/chat_probe/make_conv.py --heldout OUT      # the test split's hard conversions, one row per key"""
import json, random, sys
from blockpress.tasks import assistant
from blockpress.tasks.assistant import skills

HARD = assistant.HARD_CONVERSIONS  # the unit pairs converted by 7, 12, 24 or 60
held = sorted(k for k in assistant.heldout_keys() if k[0] == "conv" and k[1] in HARD)
held_set = frozenset(held)


def row(it):
    return json.dumps({"messages": [{"role": "user", "content": it.question},
                                    {"role": "assistant", "content": it.answer}]})


if sys.argv[1] == "--heldout":
    rng = random.Random("heldout")
    with open(sys.argv[2], "w") as f:
        for _, index, reverse, k in held:
            f.write(row(skills.conversion(rng, index, k, reverse)) + "\n")
    print(f"{len(held)} held-out questions")
else:
    n, out, seed, max_k = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    keys = [("conv", i, r, k) for i in HARD for r in (False, True) for k in range(1, max_k + 1)]
    keys = [k for k in keys if k not in held_set]
    rng = random.Random(seed)
    with open(out, "w") as f:
        for _ in range(n):
            _, index, reverse, k = rng.choice(keys)
            f.write(row(skills.conversion(rng, index, k, reverse)) + "\n")
    print(f"{n} rows over {len(keys)} questions (multipliers 1-{max_k}, {len(held)} held out)")
