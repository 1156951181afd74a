"""Conversions by 7, 12, 24 and 60 alone, thinking off (user question, assistant answer): can the model family
compute them for multipliers it never saw? Training rows leave out every question of the test split
(`assistant.heldout_keys()`); the held-out file is those questions, one row each.
python benchmarks/chat_probe/make_conv.py N OUT SEED MAX_K   # MAX_K 30: the chat world's multipliers; 99: denser
python benchmarks/chat_probe/make_conv.py --heldout OUT      # the test split's hard conversions, one row per key
--work FORM: the answer itself shows the working, and only the direction FORM works is written (§10 of
2026-11-27-cpu-assistant.md). Products (k >= 10 broken at its digits, k = 10a + b):
  split  "16 days = 16 × 24 = 10 × 24 + 6 × 24 = 240 + 144 = 384 hours."
  pairs  "16 days = 16 × 24: 1 × 24 = 24, 6 × 24 = 144, 24 + 14 = 38, so 384 hours."  (one 2-digit sum)
  cols   "16 days = 16 × 24 = 10 × 24 + 6 × 24 = 240 + 144. 4 + 0 = 4. 4 + 4 = 8. 1 + 2 = 3. So 240 + 144 = 384
          hours."  (the sum in columns, as the arithmetic's thought channel writes it: `skills.add_working`)
quotients (long division, every k):
  long   "384 hours = 384 ÷ 24: 38 ÷ 24 = 1 r 14, 144 ÷ 24 = 6, so 16 days."
  product "16 days = 16 × 24 = 384 hours."; quotients too: "384 hours = 384 ÷ 24 = 16 days." (both directions)
--facts P: a share P of the rows are the products and quotients themselves, "What is 16 × 24?" -> "16 × 24 = 384."
and "What is 384 ÷ 24?" -> "384 ÷ 24 = 16.", k up to MAX_K for all four factors, taught as tables (the one-digit
tables are, §12), none that is a held-out arithmetic question of another row (§15 of 2026-11-27-cpu-assistant.md).
--sums P: a share P of the rows are additions "What is 240 + 156?" -> "240 + 156 = 396." of the kind a split
working ends with, a multiple of ten plus a number: two in three from the workings' parts (a × f × 10 + b × g,
one-digit a and b, f and g any of 7, 12, 24, 60), one in three any (10-9990 + 1-999). No sum a held-out product's
working ends with is written (§11 of 2026-11-27-cpu-assistant.md).
"""
import json, random, sys
from blockpress.tasks import assistant
from blockpress.tasks.assistant import skills

HARD = assistant.HARD_CONVERSIONS  # the unit pairs converted by 7, 12, 24 or 60
held = sorted(k for k in assistant.heldout_keys() if k[0] == "conv" and k[1] in HARD)
held_set = frozenset(held)


WORK = sys.argv[sys.argv.index("--work") + 1] if "--work" in sys.argv else None
if WORK:
    del sys.argv[sys.argv.index("--work"):sys.argv.index("--work") + 2]
    if WORK not in ("split", "pairs", "cols", "long", "product"):
        sys.exit(f"--work {WORK}: unknown form; use split, pairs, cols, long or product")
SUMS = float(sys.argv[sys.argv.index("--sums") + 1]) if "--sums" in sys.argv else 0.0
if "--sums" in sys.argv:
    del sys.argv[sys.argv.index("--sums"):sys.argv.index("--sums") + 2]
FACTS = float(sys.argv[sys.argv.index("--facts") + 1]) if "--facts" in sys.argv else 0.0
if "--facts" in sys.argv:
    del sys.argv[sys.argv.index("--facts"):sys.argv.index("--facts") + 2]
held_arith = frozenset((k[2], k[3]) for k in assistant.heldout_keys() if k[:2] == ("arith", "mul"))


def fact_row(rng, max_k: int) -> str:
    """A product k × f or the quotient it inverts (f one of 7, 12, 24, 60), never a held-out arithmetic question."""
    while True:
        k, f = rng.randint(1, max_k), rng.choice(skills.CONVERSION_FACTORS)
        if (k, f) not in held_arith and (f, k) not in held_arith:
            break
    if rng.random() < 0.5:
        q, a = rng.choice([f"What is {k} × {f}?", f"What is {k} times {f}?", f"Multiply {k} by {f}."]), \
            f"{k} × {f} = {k * f}."
    else:
        q, a = rng.choice([f"What is {k * f} ÷ {f}?", f"What is {k * f} divided by {f}?", f"Divide {k * f} by {f}."]), \
            f"{k * f} ÷ {f} = {k}."
    return json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
# the sums the held-out products' split workings end with: never a training row
held_sums = frozenset((k // 10 * skills.CONVERSIONS[i][4] * 10, k % 10 * skills.CONVERSIONS[i][4])
                      for _, i, r, k in held if not r and k >= 10)


def sum_row(rng) -> str:
    """An addition a split working could end with, not one of a held-out product's."""
    while True:
        if rng.random() < 2 / 3:
            a = rng.randint(1, 9) * rng.choice(skills.CONVERSION_FACTORS) * 10
            b = rng.randint(1, 9) * rng.choice(skills.CONVERSION_FACTORS)
        else:
            a, b = rng.randint(1, 999) * 10, rng.randint(1, 999)
        if (a, b) not in held_sums:
            it = skills.arithmetic_item("add", a, b, rng)
            return json.dumps({"messages": [{"role": "user", "content": it.question},
                                            {"role": "assistant", "content": it.answer}]})


def worked(it) -> str:
    """The answer with the working in it (WORK's form); products of k < 10 as they were."""
    k, f = it.key[3], skills.CONVERSIONS[it.key[1]][4]
    src, _, dst = it.answer.rstrip(".").partition(" = ")
    if WORK == "product":
        return f"{src} = {k * f} ÷ {f} = {dst}." if it.key[2] else f"{src} = {k} × {f} = {dst}."
    if WORK == "long":
        n = k * f
        lead, last = divmod(n, 10)
        a, r = divmod(lead, f)
        return f"{src} = {n} ÷ {f}: {lead} ÷ {f} = {a} r {r}, {r * 10 + last} ÷ {f} = {k % 10}, so {dst}."
    if k < 10:
        return it.answer
    a, b = divmod(k, 10)
    if WORK == "split":  # the chat world's "digits" answer
        return f"{src} = {skills.digits_working(k, f)} {dst}."
    if WORK == "cols":
        return f"{src} = {skills.digits_working(k, f)[:-2]}. {skills.add_working(a * f * 10, b * f)[:-1]} " \
               f"{dst.split()[1]}."
    return f"{src} = {k} × {f}: {a} × {f} = {a * f}, {b} × {f} = {b * f}, {a * f} + {b * f // 10} = " \
           f"{a * f + b * f // 10}, so {dst}."


def row(it):
    answer = worked(it) if WORK else it.answer
    return json.dumps({"messages": [{"role": "user", "content": it.question},
                                    {"role": "assistant", "content": answer}]})


if sys.argv[1] == "--heldout":
    rng = random.Random("heldout")
    with open(sys.argv[2], "w") as f:
        for _, index, reverse, k in held:
            if WORK not in (None, "product") and reverse != (WORK == "long"):
                continue
            f.write(row(skills.conversion(rng, index, k, reverse)) + "\n")
    print(f"{sum(WORK in (None, 'product') or h[2] == (WORK == 'long') for h in held)} held-out questions")
else:
    n, out, seed, max_k = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    keys = [("conv", i, r, k) for i in HARD for r in (False, True) for k in range(1, max_k + 1)]
    keys = [k for k in keys if k not in held_set and (WORK in (None, "product") or k[2] == (WORK == "long"))]
    rng = random.Random(seed)
    with open(out, "w") as f:
        for _ in range(n):
            if SUMS and rng.random() < SUMS:
                f.write(sum_row(rng) + "\n")
                continue
            if FACTS and rng.random() < FACTS:
                f.write(fact_row(rng, max_k) + "\n")
                continue
            _, index, reverse, k = rng.choice(keys)
            f.write(row(skills.conversion(rng, index, k, reverse)) + "\n")
    print(f"{n} rows over {len(keys)} questions (multipliers 1-{max_k}, {len(held)} held out"
          + (f", {SUMS:.0%} sums" if SUMS else "") + ")")
