"""Strict tools on the chat model: every eval conversation that declares tools (both splits), answered free, with
the reply grammar of `strict` tools with the call opening unguarded, and as the product runs it (guarded):
the eval's rows, calls of undeclared tools, and seconds. The table of 2026-11-28-cpu-strict-tools.md:
python benchmarks/chat_probe/strict_tools.py MODEL [n per row, default 160] [threads, default 1]"""
import sys
import time

import torch

import blockpress
from blockpress.engine.constraint import reply_grammar
from blockpress.parsing import parse_output
from blockpress.tasks import assistant
from blockpress.tasks.assistant import evaluate as ev

lm = blockpress.load(sys.argv[1], progress=False)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 160
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
tok = lm.tokenizer
stops = sorted(set(ev.stop_ids(tok)))
pad = lm.generation_config().pad_token_id
dialogs = [d for seed in (assistant.VAL_SEED, assistant.HELDOUT_SEED) for d in assistant.heldout(n, seed) if d.tools]
results = {}
for mode in ("free", "strict, unguarded", "strict"):
    t0, texts, undeclared = time.perf_counter(), [], 0
    for d in dialogs:
        prompt = ev.prompt_ids(tok, d)
        kw = {}
        if mode != "free":
            grammar, guarded = reply_grammar(tok, [{**t, "function": {**t["function"], "strict": True}}
                                                     for t in d.tools])
            kw = {"grammar": grammar, "guarded_tokens": guarded if mode == "strict" else ()}
        res = lm.generate([prompt], generator=torch.Generator().manual_seed(ev.case_seed(0, prompt)),
                          max_new_tokens=96, eos_token_id=stops, **kw)
        texts.append(ev._cut(tok, res.new_tokens[0].tolist(), set(stops), pad))
        declared = {t["function"]["name"] for t in d.tools}
        undeclared += sum(c.name not in declared for c in parse_output(texts[-1]).tool_calls)
    results[mode] = ev.summarize(dialogs, texts)
    results[mode]["seconds"] = time.perf_counter() - t0
    print(f"{mode}: {undeclared} calls of undeclared tools, {results[mode]['seconds']:.0f} s", flush=True)
print(f"{len(dialogs)} conversations that declare tools")
print(ev.format_table(results))
