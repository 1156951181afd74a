"""The shipped chat model's closed world: a tiny assistant that speaks the Gemma 4 chat format.

- `skills`: single questions with one canonical answer and a short working (arithmetic, unit
  conversions, dates, letters, rewrites);
- `dialogs`: whole conversations around them (system turn, thinking, tool declarations, tool calls and
  tool responses, JSON answers, follow-ups), as OpenAI-style chat rows with what a right reply does;
- `tokenizer`: the model's own byte-level BPE holding every Gemma 4 special token;
- `evaluate`: score replies (per-skill exact answers, tool use, thinking well-formed) and print the table.

Splits: the held-out set (`heldout(n)`, seed "assistant/heldout") is drawn first, stratified by table
row; the training stream (`train_dialogs`) redraws every conversation that uses a question (operands, word,
date; `skills.Item.key`) of the held-out set, so eval questions are never trained on; a mix made with
`mix_exclude(tables=True)` (prepare_chat.py --teach-tables) is the one exception, for the one-digit facts (`TABLES`).
"""

from __future__ import annotations

import functools
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
    out += [("smalltalk", None)]  # last: the strata before it keep their seeds
    return out


def heldout(n: int = 40, seed: str = HELDOUT_SEED) -> list[dialogs.Dialog]:
    """n conversations per stratum, thinking on for every other one; each stratum's are the first n of
    heldout(m)'s for m > n. Always drawn with the default `dialogs.HISTORY`: a split is one set of questions,
    whatever history a training mix being made asks for (its exclusion, `heldout_keys`, is computed inside it)."""
    out, history = [], dialogs.HISTORY.set(1)
    try:
        for s, (kind, make) in enumerate(strata()):
            for i in range(n):
                rng = random.Random(f"{seed}/{s}/{i}")
                d = dialogs.conversation(rng, kind, make(rng) if make else None)
                out.append(_set_thinking(d, i % 2 == 1, rng, kind, make))
    finally:
        dialogs.HISTORY.reset(history)
    return out


def _set_thinking(d: dialogs.Dialog, thinking: bool, rng, kind, make) -> dialogs.Dialog:
    if d.thinking == thinking:
        return d
    for _ in range(100):  # redraw from the same stream until the coin agrees (deterministic)
        d = dialogs.conversation(rng, kind, make(rng) if make else None)
        if d.thinking == thinking:
            return d
    raise RuntimeError("could not draw a conversation with the requested thinking mode")


# The one-digit sums and products: 200 facts, a table a person learns by heart. The held-out set's first 200
# conversations of the "add 1-digit" and "mul 1x1-digit" rows ask 181 of them (184 with its other rows' earlier
# turns), so a mix that leaves out every held-out question (the default) teaches almost none as a question; a mix made with `prepare_chat.py --teach-tables`
# leaves them in (`heldout_keys() - TABLES`), and for a model trained on it those two rows measure recall.
TABLES = frozenset(("arith", op, a, b) for op in ("add", "mul") for a in range(10) for b in range(10))


def heldout_keys(n: int = 200, seed: str = HELDOUT_SEED) -> frozenset:
    """The questions (keys) of the first n conversations per stratum of a split: what training leaves out."""
    return frozenset(k for d in heldout(n, seed) for k in d.keys)


def mix_exclude(val: bool = False, tables: bool = False) -> frozenset:
    """What a training mix leaves out: the test split's questions; with `val`, the validation split's as well; with
    `tables`, less the one-digit sums and products (TABLES), which the mix may then ask."""
    out = heldout_keys() | (heldout_keys(seed=VAL_SEED) if val else frozenset())
    return out - TABLES if tables else out


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


CONVERSION_FACTORS = skills.CONVERSION_FACTORS  # 7, 12, 24, 60
HARD_CONVERSIONS = [i for i, c in enumerate(skills.CONVERSIONS) if c[4] in CONVERSION_FACTORS]
WIDE_MULTIPLIERS = 99  # the "wide" drills' multipliers for 7, 12, 24, 60; a conversion question asks up to 30


def _factor_product(rng: random.Random) -> skills.Item:
    """k x f (or f x k) for a conversion factor f that is not a power of ten and k up to 30."""
    k, f = rng.randint(1, 30), rng.choice(CONVERSION_FACTORS)
    a, b = (k, f) if rng.random() < 0.5 else (f, k)
    return skills.arithmetic_item("mul", a, b, rng)


def _small_difference(rng: random.Random) -> skills.Item:
    """A 2-digit subtraction whose difference has one digit (0-9): the working's tens column is 0, and the answer
    drops it ("4 - 4 = 0. So 45 - 44 = 1."), the case stage 17 of scripts/finetune_chat.py got wrong most often."""
    a = rng.randint(10, 99)
    return skills.arithmetic_item("sub", a, a - rng.randint(0, min(9, a - 10)), rng)


def _halves(first: str, second: str, digits: tuple[int, int]):
    """An ask of arithmetic: `first` in the first half of the drill's share, `second` in the second."""
    return lambda rng, r, lo, hi: skills.arithmetic(rng, first if r < (lo + hi) / 2 else second, digits)


# What a drill can ask: item(rng, r, lo, hi), r the drill's draw within [lo, hi), its share of the drills.
_ASKS = {
    "sums": _halves("add", "sub", (2, 2)),  # 2-digit addition and subtraction
    "conversion": lambda rng, *_: skills.conversion(rng),  # any unit conversion
    "factor": lambda rng, *_: skills.conversion(rng, rng.choice(HARD_CONVERSIONS)),  # by 7, 12, 24 or 60
    "factor wide": lambda rng, *_: skills.conversion(rng, rng.choice(HARD_CONVERSIONS),  # the same, k up to 99
                                                     rng.randint(1, WIDE_MULTIPLIERS)),
    "product": lambda rng, *_: _factor_product(rng),
    "table": _halves("add", "mul", (1, 1)),  # a fact of TABLES: a one-digit sum or product
    "sub": lambda rng, *_: skills.arithmetic(rng, "sub", (2, 2)),  # 2-digit subtraction
    "small difference": lambda rng, *_: _small_difference(rng),  # 2-digit subtraction, a one-digit difference
}

# drill set: [(upper end of the draw, what it asks)] in order; a draw past the last one is a tool call.
# - goals: what the eval's goals name: 2-digit sums (6 in 10), conversions (1 in 4), tool calls;
# - conversions: the goal rows with conversions weighted up (3 in 10) and the products by 7, 12, 24, 60 they need;
# - factors: the conversions a power of ten does not do weighted up (4 in 10), with the 2-digit sums (4 in 10) a
#   "steps" working is made of;
# - wide: factors, the multipliers of 7, 12, 24 and 60 drawn up to WIDE_MULTIPLIERS instead of 30. It asks whether
#   more examples of each factor teach a small model its rule, where thirty multipliers with the test split's kept
#   out leave ~16 a factor and direction. For the shipped model they did not (benchmarks/results/
#   2026-11-27-cpu-assistant.md §9: stage 10 of scripts/finetune_chat.py); with the "digits" answers, which build a
#   product from one-digit facts, they give those facts and sums more examples (stage 11);
# - products: wide, twice as many of those conversions (6 in 10): with the "digits" answers, about a third of a mix
#   at 85 % drills is a worked product, as dense as the conversions-only probe that built unseen products from seen
#   facts (§10-11; stages 12 and 13).
# - tables: goals, a fifth of the drills given to the one-digit sums and products (TABLES), which a mix made with
#   --teach-tables may ask (stage 15);
# - tables-tools: tables, with a share of the drills given to the tool conversations a goal mix does not drill: a
#   request no declared tool fits, answered without a call, and an answer from a tool's response (stage 16).
# - subtraction: tables-tools with the 2-digit sums given to subtraction: 2 in 10 drills, and 15 in 100 with a
#   one-digit difference, which stage 17 got wrong 2 times in 5 (stage 18);
# - refusals: a quarter of the drills a request whose fitting tool is not declared while others are
#   ("no_call_offered"), where stage 17 called the undeclared tool 2 times in 5, and 3 in 10 a tool call
#   (the contrast: the fitting tool declared); the goal rows and the tables keep a share (stage 19).
# - sub-refusals: subtraction with its 2-digit subtraction cut to 2 in 10 drills (half with a one-digit difference;
#   subtraction: 35 in 100) and requests no tool fits to 1 in 20, for refusals' request whose fitting tool is not
#   declared (2 in 10), so that a model trained on "subtraction" keeps its differences while it learns the refusals
#   (stage 23).
# - smalltalk: subtraction with half its conversions and a fifth of its tool calls given to small talk (greetings,
#   questions about the assistant, thanks, goodbyes, requests outside its skills: `dialogs.TALK`), 8 in 100
#   (stage 26); smalltalk-more: 16 in 100, from no_call, tool_answer and the tool calls (stage 27).
# An entry may name a conversation kind of `dialogs.conversation` ("no_call", "tool_answer", ...) instead of an ask.
_SHARES = {"goals": [(0.6, "sums"), (0.85, "conversion")],
           "conversions": [(0.4, "sums"), (0.7, "conversion"), (0.85, "product")],
           "factors": [(0.4, "sums"), (0.8, "factor")],
           "wide": [(0.4, "sums"), (0.7, "factor wide"), (0.8, "conversion")],
           "products": [(0.6, "factor wide"), (0.8, "sums"), (0.9, "conversion")],
           "tables": [(0.45, "sums"), (0.65, "conversion"), (0.85, "table")],
           "tables-tools": [(0.35, "sums"), (0.5, "conversion"), (0.65, "table"), (0.75, "no_call"),
                            (0.85, "tool_answer")],
           "subtraction": [(0.1, "sums"), (0.3, "sub"), (0.45, "small difference"), (0.55, "conversion"),
                           (0.65, "table"), (0.75, "no_call"), (0.85, "tool_answer")],
           "refusals": [(0.15, "sums"), (0.25, "conversion"), (0.35, "table"), (0.6, "no_call_offered"),
                        (0.7, "tool_answer")],
           "sub-refusals": [(0.1, "sums"), (0.2, "sub"), (0.3, "small difference"), (0.4, "conversion"),
                            (0.5, "table"), (0.7, "no_call_offered"), (0.75, "no_call"), (0.85, "tool_answer")],
           "smalltalk": [(0.1, "sums"), (0.3, "sub"), (0.45, "small difference"), (0.5, "conversion"),
                         (0.6, "table"), (0.7, "no_call"), (0.8, "tool_answer"), (0.88, "smalltalk")],
           "smalltalk-more": [(0.1, "sums"), (0.3, "sub"), (0.45, "small difference"), (0.5, "conversion"),
                              (0.6, "table"), (0.67, "no_call"), (0.74, "tool_answer"), (0.9, "smalltalk")]}


def _shared_drill(shares: list, rng: random.Random) -> tuple[str, skills.Item | None]:
    """One drill of a `_SHARES` set: the first entry whose upper end the draw is under asks it (or is a conversation
    of that kind); else a tool call."""
    r, lo = rng.random(), 0.0
    for hi, ask in shares:
        if r < hi:
            return ("skill", _ASKS[ask](rng, r, lo, hi)) if ask in _ASKS else (ask, None)
        lo = hi
    return "call", None


DRILLS = {"broad": _broad_drill, **{name: functools.partial(_shared_drill, shares) for name, shares in _SHARES.items()}}


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
