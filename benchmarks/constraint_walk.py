"""The host cost of structured output: one `Constraint.walk` of a 256-token canvas, by vocabulary size.

    python benchmarks/constraint_walk.py [--vocab 512 32768 262144] [--steps 16] [--canvas 256]

A grammar-constrained row is walked once per denoising step, on the host, while the device waits for the next step's
input. This times that walk where no model is needed: a tokenizer with V tokens (the tests' tiny Gemma-4 tokenizer,
filled up to V with seeded random pieces of 2-10 characters, as a large vocabulary's many long pieces), a JSON
Schema with strings, integers, numbers and an array, and the logits of a model that writes a valid answer: per step,
its tokens lifted above noise that shrinks from step to step (a canvas settling), so that the walk's candidates hold
the answer's token nearly everywhere, as a trained model's do. It prints, per V, the mean walk of the steps of one
canvas and of the first step alone, and the top-k read that the walk starts with (`--device cuda`: the logits on the
GPU, as in a generation), whether the last step's walk is valid JSON and is the answer itself (the walk must not
change a valid argmax); then one JSON line.

    python benchmarks/constraint_walk.py --generation [--vocab 2048] [--steps 4] [--canvas 32]

`--generation` times whole generations instead of one canvas: `[a-z]{50}`, `[a-z]{400}` and the JSON Schema, each
walked canvas after canvas (the last step's walk committed, as a generation does) over logits of noise (a model
that writes anything) until the output closes; per grammar, the mean walk of a step in ms and the grammar masks
computed per step (`Constraint.masks`, where the code has it). The cost of a walk should not grow with the output.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import torch
from tokenizers import Tokenizer

from blockpress.engine.constraint import Constraint, grammar_for
from blockpress.testing import tiny_tokenizer_json

SCHEMA = {"type": "object", "required": ["title", "year", "score", "tags", "notes"], "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"}, "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}}, "notes": {"type": "string"}}}
ANSWER = {"title": "The Printing Press and the Canvas", "year": 2026, "score": 0.875,
          "tags": ["diffusion", "grammar", "speed"],
          "notes": "Every committed canvas obeys the schema, and the answer closes within the budget, " * 3}


def tokenizer(V: int) -> Tokenizer:
    data = json.loads(tiny_tokenizer_json())
    vocab = data["model"]["vocab"]
    rng = random.Random(0)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.:;-_\"'{}[]()!?/"
    weights = [8] * 52 + [2] * 10 + [6] + [1] * (len(chars) - 63)
    while len(vocab) < V:
        piece = "".join(rng.choices(chars, weights, k=rng.choice([2, 3, 3, 4, 4, 5, 6, 7, 8, 10])))
        vocab.setdefault(piece, len(vocab))
    return Tokenizer.from_str(json.dumps(data))


GENERATIONS = [("[a-z]{50}", {"regex": "[a-z]{50}"}, 64), ("[a-z]{400}", {"regex": "[a-z]{400}"}, 450),
               ("json schema", {"json_schema": SCHEMA}, 256)]  # name, grammar, max_new_tokens


def generations(args) -> list[dict]:
    """Per grammar of GENERATIONS, one generation walked over noise logits: ms per walk (a constrained step's host
    cost) and masks per walk."""
    C, rows = args.canvas, []
    print(f"{'grammar':>12} {'vocab':>7} {'steps':>6} {'ms a step':>10} {'masks a step':>13} {'valid':>6}")
    for V in args.vocab:
        tok = tokenizer(V)
        for name, spec, budget in GENERATIONS:
            c = Constraint(grammar_for(**spec), tok, [1], V, budget)
            g = torch.Generator().manual_seed(0)
            out, walks, masks = [], [], []
            while not c.ended and len(out) < budget:
                for _ in range(args.steps):
                    z = torch.randn(C, V, generator=g).to(args.device)
                    before = getattr(c, "masks", 0)
                    t0 = time.perf_counter()
                    walked, _, _ = c.walk(z, z.argmax(-1))
                    walks.append(time.perf_counter() - t0)
                    masks.append(getattr(c, "masks", 0) - before)
                c.advance(walked)
                out += walked
            ids = out[:out.index(1)] if 1 in out else out
            text = tok.decode(ids)
            valid = 1 in out[:budget] and (re.fullmatch(spec["regex"], text) is not None if "regex" in spec
                                           else isinstance(json.loads(text), dict))
            row = {"grammar": name, "vocab": V, "canvas": C, "steps": len(walks), "tokens": len(ids),
                   "walk_ms": 1e3 * sum(walks) / len(walks), "masks_per_walk": sum(masks) / len(masks),
                   "valid": valid}
            rows.append(row)
            print(f"{name:>12} {V:>7} {len(walks):>6} {row['walk_ms']:>10.1f} {row['masks_per_walk']:>13.1f} "
                  f"{str(valid):>6}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=None, help="default 512 32768 262144 (--generation: 2048)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps of a canvas (default 16; --generation: 4)")
    p.add_argument("--canvas", type=int, default=None, help="default 256 (--generation: 32, the shipped models')")
    p.add_argument("--generation", action="store_true", help="whole generations of three grammars over noise")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the logits live (cuda: the top-k and the masked argmax "
                   "run there, as in a generation)")
    args = p.parse_args(argv)
    gen = args.generation
    args.vocab = args.vocab or ([2048] if gen else [512, 32768, 262144])
    args.steps = args.steps or (4 if gen else 16)
    args.canvas = args.canvas or (32 if gen else 256)
    torch.set_num_threads(args.threads)
    if gen:
        print(json.dumps({"bench": "constraint_walk_generation", "results": generations(args)}))
        return 0
    C, rows = args.canvas, []
    print(f"{'vocab':>8} {'walk ms (mean of steps)':>24} {'first step ms':>14} {'top-k ms':>9} {'valid':>6} "
          f"{'answer kept':>12}")
    for V in args.vocab:
        tok = tokenizer(V)
        ids = tok.encode(json.dumps(ANSWER), add_special_tokens=False).ids[:C - 1] + [1]
        ids += [1] * (C - len(ids))
        c = Constraint(grammar_for(json_schema=SCHEMA), tok, [1], V, 1024)
        g = torch.Generator().manual_seed(0)
        spelled = torch.zeros(C, V)
        spelled[torch.arange(C), torch.tensor(ids)] = 8.0
        walks, tops, walked = [], [], None
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        for s in range(args.steps):
            z = (spelled + (1 - s / args.steps) * 3 * torch.randn(C, V, generator=g)).to(args.device)
            y = z.argmax(-1)
            sync()
            t0 = time.perf_counter()
            z.topk(16, dim=-1).indices.tolist()
            t1 = time.perf_counter()
            walked, _, _ = c.walk(z, y, y)
            t2 = time.perf_counter()
            tops.append(t1 - t0)
            walks.append(t2 - t1)
        text = tok.decode(walked[:walked.index(1)] if 1 in walked else walked)
        valid = 1 in walked and isinstance(json.loads(text), dict)
        row = {"vocab": V, "canvas": C, "steps": args.steps, "device": args.device,
               "walk_ms": 1e3 * sum(walks) / len(walks),
               "first_walk_ms": 1e3 * walks[0], "topk_ms": 1e3 * sum(tops) / len(tops), "valid": valid,
               "answer_kept": valid and json.loads(text) == ANSWER}
        rows.append(row)
        print(f"{V:>8} {row['walk_ms']:>24.1f} {row['first_walk_ms']:>14.1f} {row['topk_ms']:>9.1f} {str(valid):>6} "
              f"{str(row['answer_kept']):>12}")
    print(json.dumps({"bench": "constraint_walk", "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
