"""Word infilling eval: hide one word of a held-out passage and ask the model for it.

Each example hides one word (a seeded pick among the passage's words, not the first or last three)
behind a hole of exactly its token count, then fills it two ways with the same model and seed:
- `both sides`: prefix + hole + the rest of the passage (what diffusion allows: the text after the hole
  is on the canvas, held fixed);
- `left only`: prefix + hole (what a left-to-right model sees).
Reported per mode: exact match (the fill is the hidden word) and token accuracy over the hole.
The gap between the two rows is the value of seeing the right-hand context.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("both sides", "left only")


@dataclass
class Example:
    prefix: str
    word: str  # with its leading space, as it is tokenised in running text
    suffix: str


def read_passages(path: str | Path) -> list[str]:
    from . import read_data_file

    text = read_data_file(Path(path))
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def make_examples(passages: list[str], n: int, seed: int = 0) -> list[Example]:
    """One hidden word per passage for the first n passages with enough words (seeded by passage index)."""
    out = []
    for i, p in enumerate(passages):
        words = list(re.finditer(r" ([A-Za-z]+)", p))  # a word after a space: letters only
        if len(words) < 8:
            continue
        m = random.Random(f"infill/{seed}/{i}").choice(words[3:-3])
        out.append(Example(p[:m.start()], m.group(0), p[m.end():]))
        if len(out) == n:
            break
    return out


def evaluate(lm, examples: list[Example], seed: int = 0, **sampling: Any) -> dict[str, Any]:
    tok = lm._need_tokenizer()
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    t0 = time.perf_counter()
    for k, ex in enumerate(examples):
        target = tok.encode(ex.word)
        for mode in MODES:
            tpl = (ex.prefix.replace("[MASK", "[ MASK") + f"[MASK:{len(target)}]"
                   + (ex.suffix.replace("[MASK", "[ MASK") if mode == "both sides" else ""))
            r = lm.infill(tpl, seed=seed * 100003 + k, **sampling)
            got = [t for t, h in zip(r.region_ids, r.hole_mask) if h][:len(target)]
            rows[mode].append({"word": ex.word.strip(), "fill": r.fills[0].strip(), "exact": r.fills[0] == ex.word,
                               "token_accuracy": sum(a == b for a, b in zip(got, target)) / len(target)})
    summary = {m: {"exact_match": sum(x["exact"] for x in rs) / max(len(rs), 1),
                   "token_accuracy": sum(x["token_accuracy"] for x in rs) / max(len(rs), 1), "n": len(rs)}
               for m, rs in rows.items()}
    return {"summary": summary, "rows": rows, "seconds": time.perf_counter() - t0}


def format_report(res: dict[str, Any]) -> str:
    lines = ["| context | exact match | token accuracy | n |", "|---|---:|---:|---:|"]
    for m, s in res["summary"].items():
        lines.append(f"| {m} | {100 * s['exact_match']:.1f} % | {100 * s['token_accuracy']:.1f} % | {s['n']} |")
    return "\n".join(lines)
