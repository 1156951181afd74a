"""The shipped chat model's closed world: a tiny assistant that speaks the Gemma 4 chat format.

- `skills`: single questions with one canonical answer and a short working (arithmetic, unit
  conversions, dates, letters, rewrites);
- `dialogs`: whole conversations around them (system turn, thinking, tool declarations, tool calls and
  tool responses, JSON answers, follow-ups), as OpenAI-style chat rows with what a right reply does;
- `tokenizer`: the model's own byte-level BPE holding every Gemma 4 special token;
- `evaluate`: score replies (per-skill exact answers, tool use, thinking well-formed) and print the table.

Splits: the held-out set (`heldout(n)`, seed "assistant/heldout") is drawn first, stratified by table
row; the training stream (`train_dialogs`) redraws every conversation that uses a question (operands, word,
date; `skills.Item.key`) of the held-out set, so eval questions are never trained on.
"""

from __future__ import annotations

import random
from pathlib import Path

from . import dialogs, skills

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent.parent / "assets" / "assistant"
HELDOUT_SEED = "assistant/heldout"
VAL_SEED = "assistant/val"  # the same strata drawn again: for choosing sampler settings (kept out of training only
# by mixes made with prepare_chat.py --holdout-val; otherwise a validation question may be a training one)

# held-out strata: (row name, kind, item generator or None)
_ARITH = [("add", (1, 1)), ("add", (2, 2)), ("add", (3, 3)), ("sub", (2, 2)), ("sub", (3, 3)), ("mul", (1, 1)),
          ("mul", (2, 1)), ("mul", (2, 2))]


def strata():
    """[(kind, item factory or None)]: one entry per stratum of the held-out set."""
    out = [("skill", lambda r, op=op, d=d: skills.arithmetic(r, op, d)) for op, d in _ARITH]
    out += [("skill", skills.conversion), ("skill", skills.date), ("skill", skills.letters), ("skill", skills.rewrite)]
    out += [("json", None), ("call", None), ("tool_answer", None), ("no_call", None), ("followup", None)]
    return out


def heldout(n: int = 40, seed: str = HELDOUT_SEED) -> list[dialogs.Dialog]:
    """n conversations per stratum, thinking on for every other one; each stratum's are the first n of
    heldout(m)'s for m > n."""
    out = []
    for s, (kind, make) in enumerate(strata()):
        for i in range(n):
            rng = random.Random(f"{seed}/{s}/{i}")
            d = dialogs.conversation(rng, kind, make(rng) if make else None)
            out.append(_set_thinking(d, i % 2 == 1, rng, kind, make))
    return out


def _set_thinking(d: dialogs.Dialog, thinking: bool, rng, kind, make) -> dialogs.Dialog:
    if d.thinking == thinking:
        return d
    for _ in range(100):  # redraw from the same stream until the coin agrees (deterministic)
        d = dialogs.conversation(rng, kind, make(rng) if make else None)
        if d.thinking == thinking:
            return d
    raise RuntimeError("could not draw a conversation with the requested thinking mode")


def heldout_keys(n: int = 200, seed: str = HELDOUT_SEED) -> frozenset:
    """The questions (keys) of the first n conversations per stratum of a split: what training leaves out."""
    return frozenset(k for d in heldout(n, seed) for k in d.keys)


def train_dialogs(count: int, seed: int = 0, exclude: frozenset | None = None):
    """`count` training conversations; conversation i comes from its own seeded RNG, and one that uses a
    held-out question is redrawn from the same RNG."""
    exclude = heldout_keys() if exclude is None else exclude
    for i in range(count):
        rng = random.Random(f"assistant/train/{seed}/{i}")
        while True:
            d = dialogs.conversation(rng)
            if not any(k in exclude for k in d.keys):
                yield d
                break


DRILL_DIGITS = {"add": [(1, 1), (2, 1), (2, 2), (3, 3)], "sub": [(2, 1), (2, 2), (3, 3)], "mul": [(1, 1), (2, 1), (2, 2)]}


def _broad_drill(rng: random.Random) -> tuple[str, skills.Item | None]:
    """Arithmetic (3 in 4; short operands weighted up) or a unit conversion."""
    if rng.random() < 0.75:
        op = rng.choice(list(DRILL_DIGITS))
        return "skill", skills.arithmetic(rng, op, rng.choice(DRILL_DIGITS[op]))
    return "skill", skills.conversion(rng)


def _goal_drill(rng: random.Random) -> tuple[str, skills.Item | None]:
    """The rows the eval's goals name: 2-digit addition and subtraction (3 in 10 each), a unit conversion
    (1 in 4), a tool call (the rest)."""
    r = rng.random()
    if r < 0.6:
        return "skill", skills.arithmetic(rng, "add" if r < 0.3 else "sub", (2, 2))
    if r < 0.85:
        return "skill", skills.conversion(rng)
    return "call", None


CONVERSION_FACTORS = skills.CONVERSION_FACTORS  # 7, 12, 24, 60


def _conversion_drill(rng: random.Random) -> tuple[str, skills.Item | None]:
    """The goal rows with conversions weighted up, and the products they need: 2-digit addition and subtraction
    (2 in 10 each), a unit conversion (3 in 10), a product k x f of a conversion factor f that is not a power of ten
    and k up to 30, either order (15 in 100), a tool call (the rest)."""
    r = rng.random()
    if r < 0.4:
        return "skill", skills.arithmetic(rng, "add" if r < 0.2 else "sub", (2, 2))
    if r < 0.7:
        return "skill", skills.conversion(rng)
    if r < 0.85:
        k, f = rng.randint(1, 30), rng.choice(CONVERSION_FACTORS)
        a, b = (k, f) if rng.random() < 0.5 else (f, k)
        return "skill", skills.arithmetic_item("mul", a, b, rng)
    return "call", None


HARD_CONVERSIONS = [i for i, c in enumerate(skills.CONVERSIONS) if c[4] in CONVERSION_FACTORS]


def _factor_drill(rng: random.Random) -> tuple[str, skills.Item | None]:
    """The goal rows with the conversions a power of ten does not do weighted up: 2-digit addition and subtraction
    (2 in 10 each, the sums a "steps" working is made of), a conversion by 7, 12, 24 or 60 (4 in 10), a tool call
    (the rest)."""
    r = rng.random()
    if r < 0.4:
        return "skill", skills.arithmetic(rng, "add" if r < 0.2 else "sub", (2, 2))
    if r < 0.8:
        return "skill", skills.conversion(rng, rng.choice(HARD_CONVERSIONS))
    return "call", None


WIDE_MULTIPLIERS = 99  # the "wide" drills' multipliers for 7, 12, 24, 60; a conversion question asks up to 30


def _wide_drill(rng: random.Random) -> tuple[str, skills.Item | None]:
    """`_factor_drill` with the multipliers of 7, 12, 24 and 60 drawn up to WIDE_MULTIPLIERS instead of 30: 2-digit
    addition and subtraction (2 in 10 each), a conversion by one of those factors (3 in 10), any conversion (1 in 10),
    a tool call (the rest). It asks whether more examples of each factor teach a small model its rule, where thirty
    multipliers with the test split's kept out leave ~16 a factor and direction. For the shipped model they did not
    (benchmarks/results/2026-11-27-cpu-assistant.md §9: stage 10 of scripts/finetune_chat.py); with the "digits"
    answers, which build a product from one-digit facts, they give those facts and sums more examples (stage 11)."""
    r = rng.random()
    if r < 0.4:
        return "skill", skills.arithmetic(rng, "add" if r < 0.2 else "sub", (2, 2))
    if r < 0.7:
        return "skill", skills.conversion(rng, rng.choice(HARD_CONVERSIONS), rng.randint(1, WIDE_MULTIPLIERS))
    if r < 0.8:
        return "skill", skills.conversion(rng)
    return "call", None


def _product_drill(rng: random.Random) -> tuple[str, skills.Item | None]:
    """`_wide_drill` three times as dense in conversions by 7, 12, 24 and 60 (multipliers up to WIDE_MULTIPLIERS):
    such a conversion (6 in 10), 2-digit addition and subtraction (1 in 10 each), any conversion (1 in 10), a tool
    call (the rest). With the "digits" answers, about a third of a mix at 85 % drills is a worked product, as dense as
    the conversions-only probe that built unseen products from seen facts (2026-11-27-cpu-assistant.md §10-11)."""
    r = rng.random()
    if r < 0.6:
        return "skill", skills.conversion(rng, rng.choice(HARD_CONVERSIONS), rng.randint(1, WIDE_MULTIPLIERS))
    if r < 0.8:
        return "skill", skills.arithmetic(rng, "add" if r < 0.7 else "sub", (2, 2))
    if r < 0.9:
        return "skill", skills.conversion(rng)
    return "call", None


DRILLS = {"broad": _broad_drill, "goals": _goal_drill, "conversions": _conversion_drill, "factors": _factor_drill,
          "wide": _wide_drill, "products": _product_drill}


def drilled_dialogs(count: int, seed: int, share: float, exclude: frozenset | None = None, drills: str = "broad"):
    """`count` training conversations of which about `share` are drills: a conversation in the full chat format
    (system turns, thinking on or off, earlier exchanges, tools that do not fit) on a question `DRILLS[drills]`
    draws: "broad", arithmetic of every size or a unit conversion, the skills a tiny model learns last; "goals",
    only what the eval's goals name. The rest is the normal stream (`train_dialogs(count, seed)`, in order).
    Conversation i draws from its own seeded RNG; one that uses a held-out question is redrawn."""
    exclude = heldout_keys() if exclude is None else exclude
    draw = DRILLS[drills]
    rest = train_dialogs(count, seed=seed, exclude=exclude)
    for i in range(count):
        rng = random.Random(f"assistant/mix/{seed}/{i}")
        if rng.random() >= share:
            yield next(rest)
            continue
        while True:
            kind, item = draw(rng)
            d = dialogs.conversation(rng, kind, item)
            if not any(k in exclude for k in d.keys):
                yield d
                break
