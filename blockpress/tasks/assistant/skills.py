"""The assistant's closed world, one question at a time: arithmetic, unit conversions, dates, letters, rewrites.

Every generator takes a `random.Random` and returns an `Item`: the question, its one canonical answer (the
assistant turn's content), a short visible working (the thought channel's text when thinking is on), the
answer's JSON form where it has one, and a `key` naming the question's substance (operands, word, date) so
that the held-out set's questions can be kept out of the training stream. Answers are deterministic
functions of the question; phrasing varies.
"""

from __future__ import annotations

import random
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Item:
    skill: str  # row of the eval table
    key: tuple  # the question's substance, phrasing aside (held-out exclusion)
    question: str
    answer: str  # canonical content of the assistant turn
    working: str  # thought-channel text
    data: Any = None  # the answer as JSON (None: the skill has no JSON form)
    extra: dict = field(default_factory=dict, compare=False)  # values a follow-up question can build on


MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]  # a common year
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = """apple banana cherry grape lemon mango orange peach melon river stone cloud storm winter summer autumn
garden window letter pencil rabbit turtle monkey tiger zebra parrot dragon castle bridge market planet rocket
silver golden purple yellow little coffee butter cookie pepper tomato potato carrot salad pizza bottle kitten
puppy spider flower forest island valley desert ocean beach mountain village doctor teacher farmer painter
hello world strawberry mississippi banana balloon committee coconut giraffe hippo penguin dolphin elephant
library pillow mirror ladder hammer blanket basket jacket pocket engine camera guitar violin piano trumpet
""".split()
WORDS = sorted(set(WORDS))
POLITE = ["give me the salt", "close the door", "open the window", "send the report", "call me later",
          "pass the bread", "turn off the light", "wait here", "sign this form", "check the oven",
          "feed the cat", "water the plants", "clean the table", "bring the map", "read this note"]


def _pick(rng: random.Random, options: list[str], **kw) -> str:
    return rng.choice(options).format(**kw)


def _digits(rng: random.Random, n: int) -> int:
    return rng.randint(10 ** (n - 1) if n > 1 else 0, 10 ** n - 1)


# ------------------------------------------------------------------------------------------- arithmetic
ADD_Q = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "{a} + {b} = ?",
         "What's the sum of {a} and {b}?", "How much is {a} plus {b}?"]
SUB_Q = ["What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}.",
         "{a} - {b} = ?", "How much is {a} minus {b}?", "Take {b} away from {a}."]
MUL_Q = ["What is {a} × {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}.",
         "{a} x {b} = ?", "What's the product of {a} and {b}?", "How much is {a} times {b}?"]
SYMBOL = {"add": "+", "sub": "-", "mul": "×"}


def add_working(a: int, b: int) -> str:
    """Column addition from the units: one line per column, carries named."""
    lines, carry, i = [], 0, 0
    while a // 10 ** i or b // 10 ** i or i == 0:
        da, db = a // 10 ** i % 10, b // 10 ** i % 10
        s = da + db + carry
        lines.append(f"{da} + {db}{' + 1' if carry else ''} = {s}" + (", carry 1." if s >= 10 else "."))
        carry, i = s // 10, i + 1
    return " ".join(lines) + f" So {a} + {b} = {a + b}."


# How a subtraction's working ends when the difference has fewer digits than a:
# "columns" (every model so far): the top column's 0 like any digit, "4 - 4 = 0. So 45 - 44 = 1.";
# "zeros": that column says the difference has no digit there, "4 - 4 = 0, no tens left. So 45 - 44 = 1.". The
#   models before it most often answered such a question with that 0 ("So 45 - 44 = 0."): the one-digit
#   differences were the 2-digit subtraction row's worst case (2026-11-27-cpu-assistant.md §13).
# Set for a stretch of generation (`SUB_WORKING.set("zeros")`, scripts/prepare_chat.py --sub-working).
SUB_WORKINGS = ("columns", "zeros")
SUB_WORKING: ContextVar[str] = ContextVar("SUB_WORKING", default="columns")
PLACES = ("units", "tens", "hundreds", "thousands", "ten thousands", "hundred thousands")


def sub_working(a: int, b: int) -> str:
    """Column subtraction (a >= b) from the units, borrows named (and, in the "zeros" style, the top columns the
    difference has no digit in)."""
    zeros = SUB_WORKING.get() == "zeros"
    lines, borrow, i = [], 0, 0
    while a // 10 ** i or i == 0:
        da, db = a // 10 ** i % 10, b // 10 ** i % 10
        top = f"{da} - 1" if borrow else f"{da}"
        d = da - borrow - db
        gone = f", no {PLACES[i]} left" if zeros and i and a - b < 10 ** i else ""  # the difference has no digit here
        if d < 0:
            lines.append(f"1{da}{' - 1' if borrow else ''} - {db} = {d + 10}, borrow 1{gone}.")
            borrow = 1
        else:
            lines.append(f"{top} - {db} = {d}{gone}.")
            borrow = 0
        i += 1
    return " ".join(lines) + f" So {a} - {b} = {a - b}."


def mul_working(a: int, b: int) -> str:
    """Split the two-digit factor into tens and units; one partial product a line."""
    if a < 10 and b < 10:
        return f"{a} × {b} = {a * b}."
    if b < 10:  # 2-digit x 1-digit: (tens + units) x b
        t, u = a - a % 10, a % 10
        return f"{t} × {b} = {t * b}. {u} × {b} = {u * b}. {t * b} + {u * b} = {a * b}. So {a} × {b} = {a * b}."
    t, u = b - b % 10, b % 10
    return (f"{a} × {t} = {a * t}. {a} × {u} = {a * u}. {a * t} + {a * u} = {a * b}. "
            f"So {a} × {b} = {a * b}.")


def arithmetic(rng: random.Random, op: str | None = None, digits: tuple[int, int] | None = None) -> Item:
    """+ and - up to 3 digits, x up to 2 digits by 2 digits: what the assistant does without a tool."""
    op = op or rng.choices(["add", "sub", "mul"], [4, 3, 3])[0]
    if digits is None:
        digits = rng.choices([(1, 1), (2, 1), (2, 2)], [1, 3, 6])[0] if op == "mul" else \
            rng.choices([(1, 1), (2, 1), (2, 2), (3, 2), (3, 3)], [1, 2, 7, 2, 4])[0]
    a, b = _digits(rng, digits[0]), _digits(rng, digits[1])
    if op == "mul" and rng.random() < 0.3:
        a, b = b, a
    if op == "sub" and a < b:
        a, b = b, a
    elif op != "sub" and rng.random() < 0.5:
        a, b = b, a
    return arithmetic_item(op, a, b, rng)


def skill_name(op: str, a: int, b: int) -> str:
    big = max(len(str(a)), len(str(b)))
    if op == "mul":
        small = min(len(str(a)), len(str(b)))
        return f"mul {big}x{small}-digit"
    return f"{op} {big}-digit"


def arithmetic_item(op: str, a: int, b: int, rng: random.Random) -> Item:
    c = {"add": a + b, "sub": a - b, "mul": a * b}[op]
    q = _pick(rng, {"add": ADD_Q, "sub": SUB_Q, "mul": MUL_Q}[op], a=a, b=b)
    work = {"add": add_working, "sub": sub_working, "mul": mul_working}[op]
    if op == "mul" and a < 10 <= b:  # split the two-digit factor, name the product as asked
        work_text = work(b, a).replace(f"So {b} × {a}", f"So {a} × {b}")
    else:
        work_text = work(a, b)
    return Item(skill_name(op, a, b), ("arith", op, a, b), q, f"{a} {SYMBOL[op]} {b} = {c}.", work_text,
                {"result": c}, {"result": c})


# ------------------------------------------------------------------------------------------- conversions
# (unit, plural, other unit, plural, factor): 1 unit = factor other units
CONVERSIONS = [("km", "km", "m", "m", 1000, "kilometers", "meters"),
               ("m", "m", "cm", "cm", 100, "meters", "centimeters"),
               ("cm", "cm", "mm", "mm", 10, "centimeters", "millimeters"),
               ("kg", "kg", "g", "g", 1000, "kilograms", "grams"),
               ("L", "L", "mL", "mL", 1000, "liters", "milliliters"),
               ("hour", "hours", "minute", "minutes", 60, "hours", "minutes"),
               ("minute", "minutes", "second", "seconds", 60, "minutes", "seconds"),
               ("day", "days", "hour", "hours", 24, "days", "hours"),
               ("week", "weeks", "day", "days", 7, "weeks", "days"),
               ("foot", "feet", "inch", "inches", 12, "feet", "inches")]
CONV_Q = ["Convert {v} {u} to {to}.", "How many {to} are in {v} {u}?", "What is {v} {u} in {to}?",
          "{v} {u} is how many {to}?", "Change {v} {u} into {to}."]


def _unit(n: int, sing: str, plural: str) -> str:
    return f"{n} {sing if n == 1 else plural}"


# How a conversion's working (the thought channel) is written, for the factors that are not powers of ten:
# "product" (the shipped model's data): the product or quotient in one line, "16 × 12 = 192";
# "steps": a product as the sums of doublings it is made of (the one skill the model has, 2-digit addition),
#   "and 12 = 10 + 2. 16 + 16 = 32. 160 + 32 = 192."; a quotient only named ("divide 192 by 12"), the answer
#   giving it, as with thinking off;
# "method": the rule only ("multiply 16 by 12"), the answer giving the number, as with thinking off.
# "digits": a product's answer itself shows the working, with the multiplier k <= 99 broken at its digits, so
#   that a new question is made of facts seen in other ones (k × f for one digit k) and one sum:
#   "16 days = 16 × 24 = 10 × 24 + 6 × 24 = 240 + 144 = 384 hours.", "2 days = 2 × 24 = 48 hours."; a quotient's
#   answer stays plain (long division in the answer did worse than none: 2026-11-27-cpu-assistant.md §10); the
#   thought channel names the rule as "method" does. Whatever the style, the eval takes either form of a product
#   (`Item.extra["answers"]`).
# Set for a stretch of generation (`CONVERSION_WORKING.set("steps")`, e.g. scripts/prepare_chat.py
# --conversion-working); powers of ten keep the one-line working in every style.
CONVERSION_FACTORS = sorted({c[4] for c in CONVERSIONS if c[4] not in (10, 100, 1000)})  # 7, 12, 24, 60
CONVERSION_WORKINGS = ("product", "steps", "method", "digits")
CONVERSION_WORKING: ContextVar[str] = ContextVar("CONVERSION_WORKING", default="product")
# factor (each of CONVERSION_FACTORS): (how it splits, each addition as (left, right) multiples of k, the multiple
# that is then times 10)
_DOUBLINGS = {7: ("4 + 2 + 1", [(1, 1), (2, 2), (4, 2), (6, 1)], None),
              12: ("10 + 2", [(1, 1), (10, 2)], None),
              24: ("20 + 4", [(1, 1), (2, 2), (20, 4)], None),
              60: ("6 × 10", [(1, 1), (2, 2), (4, 2)], 6)}


def product_steps(k: int, f: int) -> str:
    """k × f (f in 7, 12, 24, 60) as additions of multiples of k, from the doubling k + k up (the split of f
    that orders them, e.g. 24 = 20 + 4, is the working's to name)."""
    _, adds, tens = _DOUBLINGS[f]
    lines = []
    for a, b in adds:
        lines.append(f"{a * k} + {b * k} = {(a + b) * k}.")
    if tens:
        lines.append(f"{tens * k} × 10 = {tens * k * 10}.")
    return " ".join(lines)


def conversion(rng: random.Random, index: int | None = None, value: int | None = None,
               reverse: bool | None = None) -> Item:
    """Up (x factor) or down (/ factor, exact) between two units of one measure."""
    index = rng.randrange(len(CONVERSIONS)) if index is None else index
    u, up, v, vp, f, uname, vname = CONVERSIONS[index]
    reverse = rng.random() < 0.35 if reverse is None else reverse
    k = value if value is not None else rng.randint(1, 99 if f >= 100 else 30)
    style = CONVERSION_WORKING.get() if f in CONVERSION_FACTORS else "product"
    if reverse:  # k * f of the small unit -> k of the big one
        src, dst, n_src, n_dst = (v, vp, vname), (u, up, uname), k * f, k
        work = f"1 {u} = {f} {vp}, so " + (f"divide {n_src} by {f}." if style != "product" else
                                          f"{_unit(n_src, v, vp)} = {n_src} ÷ {f} = {_unit(n_dst, u, up)}.")
    else:
        src, dst, n_src, n_dst = (u, up, uname), (v, vp, vname), k, k * f
        if style == "product":
            work = f"1 {u} = {f} {vp}, so {_unit(n_src, u, up)} = {n_src} × {f} = {_unit(n_dst, v, vp)}."
        elif style in ("method", "digits"):  # "digits" writes the product in the answer, below
            work = f"1 {u} = {f} {vp}, so multiply {n_src} by {f}."
        else:
            work = f"1 {u} = {f} {vp}, and {f} = {_DOUBLINGS[f][0]}. " + product_steps(k, f)
    q = _pick(rng, CONV_Q, v=n_src, u=src[1] if n_src != 1 else src[0],
              to=rng.choice([dst[2], dst[1]]))
    a, b = _unit(n_src, src[0], src[1]), _unit(n_dst, dst[0], dst[1])
    ans = f"{a} = {b}."
    extra = {"value": n_dst, "unit": dst, "index": index, "reverse": reverse}
    if f in CONVERSION_FACTORS and k <= 99 and not reverse:  # both forms are exact, whichever the data writes
        extra["answers"] = (ans, f"{a} = {digits_working(k, f)} {b}.")
        ans = extra["answers"][style == "digits"]
    return Item("conversion", ("conv", index, reverse, k), q, ans, work, {"value": n_dst, "unit": dst[1]}, extra)


def digits_working(k: int, f: int) -> str:
    """A "digits" answer's middle for k <= 99: k × f broken at k's digits; the result and its unit follow it."""
    if k < 10:
        return f"{k} × {f} ="
    tens, units = divmod(k, 10)
    return f"{k} × {f} = {tens}0 × {f} + {units} × {f} = {tens * f}0 + {units * f} ="


# ------------------------------------------------------------------------------------------- dates
def _date_after(m: int, d: int, n: int) -> tuple[int, int]:
    d += n
    while d > MONTH_DAYS[m]:
        d -= MONTH_DAYS[m]
        m = (m + 1) % 12
    return m, d


def date(rng: random.Random) -> Item:
    kind = rng.choices(["days_after", "weekday", "month_after", "month_days"], [4, 3, 2, 1])[0]
    if kind == "days_after":
        m = rng.randrange(12)
        d = rng.randint(1, MONTH_DAYS[m])
        n = rng.randint(1, 20)
        m2, d2 = _date_after(m, d, n)
        q = _pick(rng, ["What date is {n} days after {M} {d}?", "What is the date {n} days after {M} {d}?",
                        "If today is {M} {d}, what is the date in {n} days?"], n=n, M=MONTHS[m], d=d)
        if d + n <= MONTH_DAYS[m]:
            work = f"{d} + {n} = {d + n}, still in {MONTHS[m]}."
        else:
            work = f"{MONTHS[m]} has {MONTH_DAYS[m]} days. {d} + {n} = {d + n}, {d + n} - {MONTH_DAYS[m]} = {d2}, " \
                   f"so it is {MONTHS[m2]} {d2}."
        day = "day" if n == 1 else "days"
        return Item("date", (kind, m, d, n), q.replace("1 days", "1 day"), f"{n} {day} after {MONTHS[m]} {d} is "
                    f"{MONTHS[m2]} {d2}.", work, {"date": f"{MONTHS[m2]} {d2}"})
    if kind == "weekday":
        w, n = rng.randrange(7), rng.randint(1, 13)
        w2 = (w + n) % 7
        q = _pick(rng, ["What day is {n} days after {W}?", "If today is {W}, what day is it in {n} days?",
                        "Which weekday comes {n} days after {W}?"], n=n, W=WEEKDAYS[w])
        work = (f"{n} = 7 + {n - 7}, so it is the same as {n - 7} days after {WEEKDAYS[w]}. " if n > 7 else "") + \
               ("The same day a week later." if n == 7 else
                "Counting on: " + ", ".join(WEEKDAYS[(w + i) % 7] for i in range(1, n % 7 + 1)) + ".")
        day = "day" if n == 1 else "days"
        return Item("date", (kind, w, n), q.replace("1 days", "1 day"),
                    f"{n} {day} after {WEEKDAYS[w]} is {WEEKDAYS[w2]}.", work, {"day": WEEKDAYS[w2]})
    if kind == "month_after":
        m, n = rng.randrange(12), rng.randint(1, 11)
        m2 = (m + n) % 12
        q = _pick(rng, ["Which month comes {n} months after {M}?", "What month is {n} months after {M}?"],
                  n=n, M=MONTHS[m])
        s = m + 1 + n
        work = f"{MONTHS[m]} is month {m + 1}. {m + 1} + {n} = {s}" + (f", {s} - 12 = {s - 12}" if s > 12 else "") + \
               f", month {m2 + 1} is {MONTHS[m2]}."
        mo = "month" if n == 1 else "months"
        return Item("date", (kind, m, n), q.replace("1 months", "1 month"),
                    f"{n} {mo} after {MONTHS[m]} is {MONTHS[m2]}.", work, {"month": MONTHS[m2]})
    m = rng.randrange(12)
    q = _pick(rng, ["How many days are in {M}?", "How many days does {M} have?"], M=MONTHS[m])
    if m == 1:
        return Item("date", (kind, m), q, "February has 28 days, 29 in a leap year.",
                    "February is the short month: 28 days, 29 in a leap year.", {"days": 28})
    return Item("date", (kind, m), q, f"{MONTHS[m]} has {MONTH_DAYS[m]} days.",
                f"{MONTHS[m]} is one of the {MONTH_DAYS[m]}-day months.", {"days": MONTH_DAYS[m]})


# ------------------------------------------------------------------------------------------- letters
def letters(rng: random.Random, word: str | None = None, kind: str | None = None) -> Item:
    word = word or rng.choice(WORDS)
    kind = kind or rng.choices(["count", "length", "first"], [6, 3, 1])[0]
    spelled = ", ".join(word)
    if kind == "count":
        ch = rng.choice(word) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
        n = word.count(ch)
        q = _pick(rng, ["How many times does the letter {c} appear in {w}?", "How many {c}'s are in {w}?",
                        "Count the letter {c} in \"{w}\".", "How often does {c} occur in the word {w}?"], c=ch, w=word)
        times = "time" if n == 1 else "times"
        return Item("letters", (kind, word, ch), q, f"The letter {ch} appears {n} {times} in {word}.",
                    f"Spelling {word}: {spelled}. Counting {ch}: {n}.", {"letter": ch, "word": word, "count": n},
                    {"word": word})
    if kind == "length":
        q = _pick(rng, ["How many letters are in {w}?", "How long is the word {w}?", "Count the letters in \"{w}\"."],
                  w=word)
        return Item("letters", (kind, word), q, f"{word} has {len(word)} letters.", f"{spelled}: {len(word)} letters.",
                    {"word": word, "letters": len(word)}, {"word": word})
    q = _pick(rng, ["What is the first letter of {w}?", "Which letter does {w} start with?"], w=word)
    return Item("letters", (kind, word), q, f"The first letter of {word} is {word[0]}.",
                f"{word} starts with {word[0]}.",
                {"letter": word[0]}, {"word": word})


# ------------------------------------------------------------------------------------------- rewrites
def rewrite(rng: random.Random) -> Item:
    kind = rng.choice(["upper", "reverse", "sort", "polite"])
    if kind == "upper":
        words = rng.sample(WORDS, rng.randint(1, 3))
        text = " ".join(words)
        q = _pick(rng, ["Write \"{t}\" in capital letters.", "Make this uppercase: {t}",
                        "Capitalize every letter: {t}"], t=text)
        return Item("rewrite", (kind, text), q, text.upper(), f"Each letter in capitals: {text.upper()}.",
                    {"text": text.upper()})
    if kind == "reverse":
        words = rng.sample(WORDS, rng.randint(2, 5))
        q = _pick(rng, ["Reverse this list: {t}.", "Put these words in reverse order: {t}.",
                        "Write this list backwards: {t}."], t=", ".join(words))
        out = ", ".join(reversed(words))
        return Item("rewrite", (kind, tuple(words)), q, out, f"From last to first: {out}.", list(reversed(words)))
    if kind == "sort":
        nums = rng.sample(range(1, 100), rng.randint(2, 5))
        q = _pick(rng, ["Sort from smallest to largest: {t}.", "Put these numbers in order: {t}.",
                        "Sort these numbers: {t}."], t=", ".join(map(str, nums)))
        out = ", ".join(map(str, sorted(nums)))
        return Item("rewrite", (kind, tuple(nums)), q, out,
                    f"Smallest first: {out}.", sorted(nums))
    text = rng.choice(POLITE)
    q = _pick(rng, ["Make this polite: {t}.", "Rewrite politely: {t}", "Say this more politely: {t}."], t=text)
    out = f"Could you please {text}?"
    return Item("rewrite", (kind, text), q, out, f"A request with please: {out}", {"text": out})


SKILLS: dict[str, tuple[Callable[[random.Random], Item], float]] = {  # generator, weight in the stream
    "arithmetic": (arithmetic, 0.42),
    "conversion": (conversion, 0.22),
    "date": (date, 0.13),
    "letters": (letters, 0.12),
    "rewrite": (rewrite, 0.11),
}


def any_item(rng: random.Random) -> Item:
    names = list(SKILLS)
    gen = SKILLS[rng.choices(names, [SKILLS[n][1] for n in names])[0]][0]
    return gen(rng)
