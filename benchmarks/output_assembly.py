"""The server's host work per reply: committed canvases -> text, reasoning, tool calls and logprob entries.

`server.serving.OutputAssembler` turns each committed canvas into text deltas (the stream decoder, the reply parser,
stop strings) and, when a request asks for logprobs, aligns every token with the text it returned. That runs on the
CPU beside the GPU's denoising, once per canvas per request. This script times it on the shipped chat model's
tokenizer: a reply of `--tokens` tokens fed in canvases of `--canvas`, best of `--repeats`, without and with
logprobs, and with a stop string (tokens fed one at a time).

    python benchmarks/output_assembly.py

Prints ms per reply and per canvas, then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import blockpress  # noqa: E402
from blockpress.server.serving import OutputAssembler  # noqa: E402
from blockpress.tokenizer import Tokenizer  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog; 12 + 30 = 42, and <b>bold</b> stays text. "


def time_reply(tok, ids, canvas, logprobs, stop, repeats) -> float:
    stops = [tok.token_to_id(t) for t in ("<eos>", "<turn|>") if tok.token_to_id(t) is not None]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        asm = OutputAssembler(tok, stops, len(ids) + 1, stop=stop, chat=True, logprobs=logprobs)
        for i in range(0, len(ids), canvas):
            asm.feed(ids[i:i + canvas], [(-0.1, [])] * canvas if logprobs else None)
        asm.finish()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path(blockpress.__file__).parent / "assets" / "assistant"),
                   help="a folder with tokenizer.json (default: the shipped chat model)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    tok = Tokenizer.from_dir(args.model)
    ids = (tok.encode(TEXT) * (args.tokens // 8 + 1))[:args.tokens]
    rows = {}
    for name, logprobs, stop in (("text", False, None), ("text + logprobs", True, None),
                                 ("text + stop string", False, ["never appears"])):
        s = time_reply(tok, ids, args.canvas, logprobs, stop, args.repeats)
        rows[name] = round(1000 * s, 2)
        print(f"{name:22s} {1000 * s:8.2f} ms a reply of {len(ids)} tokens, "
              f"{1000 * s * args.canvas / len(ids):7.2f} ms a canvas of {args.canvas}")
    print(json.dumps({"tokens": len(ids), "canvas": args.canvas, "ms_per_reply": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
