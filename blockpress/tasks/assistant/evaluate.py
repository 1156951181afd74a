"""Score the assistant on held-out conversations: exact answers per skill, tool use, thinking well-formed.

`replies(lm, dialogs, steps)` generates the final turn of every conversation (its prompt rendered by the
model's chat template exactly as the server renders a request, and, as there, no tool call written where the
conversation offers no tool: `parsing.call_ban`) and returns the raw text, special tokens kept, up to its stop
token; `steps=None` uses the model's generation_config.json, `steps=N` exactly N
denoising steps per canvas (early stopping off), `ar=True` greedy autoregressive decoding (the baseline,
a model trained with `--ar-only`). Each conversation samples from its own generator seeded by the seed and
its prompt, so a reply does not depend on the batch size or on which other conversations are evaluated (an
eval of the first n conversations per stratum reproduces those of a larger one).

`score(dialog, text)` parses the text as the server does (`parsing.parse_output`) and checks it against the
conversation's `expect`; `summarize` aggregates the table rows; `format_table` prints them side by side.
Rows: one per skill (exact canonical answer, string equality, or one of its other exact forms: a product by 7,
12, 24 or 60 is right as "16 days = 384 hours." and as "16 days = 16 × 24 = ... = 384 hours."; JSON rows compare
the parsed value), then
- tool call, valid args: the turn is a call of a declared tool whose arguments satisfy its JSON schema
  (required keys present, types right, no unknown keys), where the fitting tool is declared;
- tool call, right args: the exact call(s) expected (tool and argument values);
- no call when no tool fits: no call where the question needs no tool or its tool is not declared;
- no call, request no tool fits: the same on the "no tool fits" row alone, the requests a tool would answer (weather,
  time, a timer, a big calculation) when none that fits is declared: there a call of an undeclared tool is the
  likely mistake, which the row above dilutes among questions that no one would answer with a call;
- answer uses the tool response: after the tool's response, the answer quotes its values;
- thinking on / off well-formed: on, the turn opens a thought channel, closes it and then answers or
  calls; off, no channel, an answer or call; both ending at a stop token.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from ...config import fixed_steps
from ...parsing import STOP_TOKENS, call_ban, parse_output, unmark

SKILL_ROWS = ["add 1-digit", "add 2-digit", "add 3-digit", "sub 2-digit", "sub 3-digit", "mul 1x1-digit",
              "mul 2x1-digit", "mul 2x2-digit", "conversion", "date", "letters", "rewrite", "json", "follow-up",
              "tool answer", "no tool fits", "small talk"]
TOOL_ROWS = ["tool call, valid args", "tool call, right args", "no call when no tool fits",
             "no call, request no tool fits", "answer uses the tool response", "thinking on: well-formed",
             "thinking off: well-formed"]


def stop_ids(tok) -> list[int]:
    return [i for i in (tok.token_to_id(t) for t in STOP_TOKENS) if i is not None]


def case_seed(seed: int, prompt: list[int]) -> int:
    key = f"assistant/{seed}/{','.join(map(str, prompt))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def prompt_ids(tok, d) -> list[int]:
    return tok.apply_chat_template(d.messages[:-1], add_generation_prompt=True, enable_thinking=d.thinking,
                                   tools=d.tools, tokenize=True)


def _cut(tok, ids: list[int], stops: set[int], pad: int | None) -> str:
    out = []
    for t in ids:
        if t == pad:
            continue
        out.append(t)
        if t in stops:
            break
    return tok.decode(out, marked=True)  # the parser's text: see `score`


def replies(lm, dialogs, steps: int | None = None, seed: int = 0, batch_size: int = 32, ar: bool = False,
            max_new_tokens: int = 96, **sampling) -> list[str]:
    tok = lm.tokenizer
    stops = set(stop_ids(tok))
    prompts = [prompt_ids(tok, d) for d in dialogs]
    out: list[str | None] = [None] * len(dialogs)
    if ar:
        from ...train.ar import greedy_until

        for i, p in enumerate(prompts):
            out[i] = tok.decode(greedy_until(lm.module, p, max_new_tokens, stops, lm.device), marked=True)
        return out
    kw = {"max_new_tokens": max_new_tokens, "eos_token_id": sorted(stops), **sampling}
    if steps is not None:
        kw.update(fixed_steps(steps))
    pad = lm.generation_config().pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    bans = [call_ban(tok, d.tools) for d in dialogs]  # as the server and `lm.chat`: no tool offered, no call
    for b in range(0, len(order), batch_size):
        for ban in sorted({tuple(bans[i] or ()) for i in order[b:b + batch_size]}):  # a batch per ban (rows do not
            rows = [i for i in order[b:b + batch_size] if tuple(bans[i] or ()) == ban]  # depend on their batch)
            gens = [torch.Generator(device=lm.device).manual_seed(case_seed(seed, prompts[i])) for i in rows]
            res = lm.generate([prompts[i] for i in rows], generator=gens, suppress_tokens=list(ban) or None, **kw)
            for j, i in enumerate(rows):
                out[i] = _cut(tok, res.new_tokens[j].tolist(), stops, pad)
    return out


# ------------------------------------------------------------------------------------------- scoring
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def schema_valid(args: dict, schema: dict) -> bool:
    props = schema.get("properties", {})
    if any(k not in args for k in schema.get("required", [])) or any(k not in props for k in args):
        return False
    for k, v in args.items():
        want = _TYPES.get(props[k].get("type"), object)
        if not isinstance(v, want) or (isinstance(v, bool) and want is not bool):
            return False
    return True


def score(d, text: str) -> dict:
    """One reply against its conversation's `expect` -> {metric: bool} (metrics that apply only)."""
    e = d.expect
    p = parse_output(text)  # text decoded with `marked=True` (control tokens only from their ids), or plain text
    content = p.content.strip()
    calls = [(c.name, c.arguments) for c in p.tool_calls]
    finished = any(text.endswith(t) for t in STOP_TOKENS)
    r: dict = {"row": e["row"], "text": unmark(text)}
    if e["thought"]:
        r["thinking on: well-formed"] = finished and text.startswith("<|channel>thought\n") and \
            text.count("<channel|>") == 1 and bool((p.reasoning or "").strip()) and bool(content or calls)
    else:
        r["thinking off: well-formed"] = finished and "<|channel>" not in text and bool(content or calls)
    declared = {t["function"]["name"]: t["function"].get("parameters", {}) for t in d.tools or []}
    kind = e["kind"]
    if kind == "call":
        r["tool call, valid args"] = bool(calls) and all(n in declared and schema_valid(a, declared[n])
                                                         for n, a in calls)
        r["tool call, right args"] = calls == [tuple(c) for c in e["calls"]]
        r["exact"] = r["tool call, right args"]
    else:
        r["no call when no tool fits"] = not calls
        if kind == "no_call":
            r["no call, request no tool fits"] = not calls
        if e.get("data") is not None:
            try:
                r["exact"] = not calls and json.loads(content) == e["data"]
            except ValueError:
                r["exact"] = False
        else:
            r["exact"] = not calls and (content == e["answer"] or content in e.get("answers", ()))
        if kind == "tool_answer":
            r["answer uses the tool response"] = not calls and all(u in content for u in e["uses"])
            del r["no call when no tool fits"]  # the tool was called in the previous turn
    return r


def summarize(dialogs, texts: list[str]) -> dict:
    """-> {"rows": {row: [hits, n]}, "cases": [...]}: skill rows count exact answers, the others their metric."""
    rows: dict[str, list[int]] = {}
    cases = []
    for d, t in zip(dialogs, texts):
        r = score(d, t)
        cases.append(r)
        for name, ok in [(r["row"], r["exact"])] + [(k, r[k]) for k in TOOL_ROWS if k in r]:
            hit = rows.setdefault(name, [0, 0])
            hit[0] += bool(ok)
            hit[1] += 1
    return {"rows": rows, "cases": cases}


def evaluate(lm, dialogs, steps=None, seed: int = 0, batch_size: int = 32, ar: bool = False, **sampling) -> dict:
    t0 = time.perf_counter()
    texts = replies(lm, dialogs, steps, seed, batch_size, ar, **sampling)
    res = summarize(dialogs, texts)
    res["seconds"] = time.perf_counter() - t0
    return res


def format_table(results: dict[str, dict]) -> str:
    """Markdown table: one row per metric, one column per evaluated configuration."""
    names = list(results)
    order = [r for r in SKILL_ROWS if any(r in res["rows"] for res in results.values())] + TOOL_ROWS
    lines = ["| | n | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for row in order:
        cells, n = [], 0
        for name in names:
            hit = results[name]["rows"].get(row)
            cells.append("-" if hit is None else f"{100 * hit[0] / hit[1]:.1f} %")
            n = n or (hit[1] if hit else 0)  # the first column's count (a column may hold fewer strata)
        lines.append(f"| {row} | {n} | " + " | ".join(cells) + " |")
    lines.append("| seconds | | " + " | ".join(f"{results[n]['seconds']:.0f}" for n in names) + " |")
    return "\n".join(lines)
