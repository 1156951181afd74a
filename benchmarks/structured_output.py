"""Structured output on generated JSON Schemas: validity and the cost of a constrained step.

    python benchmarks/structured_output.py --n 200 --new-tokens 128 --steps 4 [--server]

Builds a random-weight tiny model (the tests' tiny Gemma-4 tokenizer, 512 ids, canvas 16) that writes noise, so
every valid output is the constraint's doing. For each of --n schemas from `blockpress.testing.random_schema`
(nested objects, arrays with bounds, enums, bounded numbers, optional fields, anyOf, strings with lengths) it
generates once with the schema, parses the text and validates it with `jsonschema`; then times a constrained
and an unconstrained generation of the same length (fixed steps). With --server it also starts `blockpress serve`
on the model (127.0.0.1) and sends every schema through the official `openai` client twice: as a chat
`response_format` json_schema, and as the parameters of a tool the request forces (`tool_choice` required);
the answer must parse and validate, and the forced call must come back in `tool_calls`. Prints a table and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import blockpress
from blockpress.errors import InputError
from blockpress.testing import random_schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="schemas")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="fixed denoising steps per canvas")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--server", action="store_true", help="also through `blockpress serve` and the openai client")
    args = p.parse_args(argv)
    import jsonschema
    from test_server import build_tiny_model

    torch.set_num_threads(args.threads)
    folder = build_tiny_model(Path(tempfile.mkdtemp()))
    lm = blockpress.load(folder, progress=False)
    ids = lm.encode_chat("Write the record:", chat=False)
    kw = dict(max_new_tokens=args.new_tokens, max_denoising_steps=args.steps, stability_threshold=None,
              confidence_threshold=None, eos_token_id=[1])
    valid = refused = 0
    failures, t_con, steps_con = [], 0.0, 0
    for i in range(args.n):
        schema = random_schema(random.Random(i))
        try:
            t0 = time.perf_counter()
            out = lm.generate([ids], generator=torch.Generator().manual_seed(i), json_schema=schema, **kw)
            t_con += time.perf_counter() - t0
            steps_con += sum(out.steps_per_canvas)
        except InputError as e:  # the budget cannot hold the schema's shortest output
            refused += 1
            failures.append({"schema": i, "refused": str(e)})
            continue
        text = lm.decode_new(out)
        try:
            jsonschema.validate(json.loads(text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append({"schema": i, "text": text, "error": str(e)[:200]})
        print(f"\r{i + 1}/{args.n} schemas, {valid} valid", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    t_free, steps_free = 0.0, 0
    for i in range(min(args.n, 50)):  # the same budget without a constraint (the output runs to max_new_tokens)
        t0 = time.perf_counter()
        out = lm.generate([ids], generator=torch.Generator().manual_seed(i), **{**kw, "eos_token_id": None})
        t_free += time.perf_counter() - t0
        steps_free += sum(out.steps_per_canvas)
    served = _through_the_server(folder, args, jsonschema) if args.server else None
    ran = args.n - refused
    ms_con, ms_free = 1e3 * t_con / max(steps_con, 1), 1e3 * t_free / max(steps_free, 1)
    print(f"| schemas | refused (budget too small) | valid | ms / step, constrained | ms / step, free |")
    print(f"|---:|---:|---:|---:|---:|")
    print(f"| {args.n} | {refused} | {valid} / {ran} ({100 * valid / max(ran, 1):.1f} %) | {ms_con:.2f} | "
          f"{ms_free:.2f} |")
    if served is not None:
        print(f"\nthrough the server (openai client): response_format json_schema {served['json_valid']} / "
              f"{served['n']} valid, forced tool calls {served['calls_valid']} / {served['n']} in tool_calls and valid")
    print(json.dumps({"bench": "structured_output", "n": args.n, "refused": refused, "valid": valid, "ran": ran,
                      "server": served,
                      "ms_per_step_constrained": ms_con, "ms_per_step_free": ms_free,
                      "new_tokens": args.new_tokens, "steps": args.steps, "threads": args.threads,
                      "torch": torch.__version__, "failures": failures[:20]}))
    ok = valid == ran and (served is None or served["json_valid"] == served["calls_valid"] == served["n"])
    return 0 if ok else 1


def _through_the_server(folder, args, jsonschema) -> dict:
    import openai
    from test_server import ServerProcess

    server = ServerProcess(folder, "--max-tokens-limit", str(args.new_tokens))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Fill in the record."}]
        extra = {"steps": args.steps}
        json_valid = calls_valid = 0
        failures = []
        for i in range(args.n):
            schema = random_schema(random.Random(i))
            fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
            try:
                r = client.chat.completions.create(model="blockpress", messages=messages, response_format=fmt, seed=i,
                                                   max_tokens=args.new_tokens, extra_body=extra)
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
                json_valid += 1
            except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                failures.append({"schema": i, "json_schema": str(e)[:200]})
            tool = {"type": "function", "function": {"name": "record", "parameters": schema}}
            try:
                r = client.chat.completions.create(model="blockpress", messages=messages, tools=[tool],
                                                   tool_choice="required", seed=i, max_tokens=args.new_tokens,
                                                   extra_body=extra)
                calls = r.choices[0].message.tool_calls or []
                assert len(calls) == 1 and calls[0].function.name == "record", r.choices[0].message
                jsonschema.validate(json.loads(calls[0].function.arguments), schema)
                calls_valid += 1
            except Exception as e:  # noqa: BLE001
                failures.append({"schema": i, "tool_call": str(e)[:200]})
            print(f"\rserver: {i + 1}/{args.n}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return {"n": args.n, "json_valid": json_valid, "calls_valid": calls_valid, "failures": failures[:20]}
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
