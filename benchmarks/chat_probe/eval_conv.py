"""make_conv.py's rows answered by a model, exact answers by unit pair (e.g. days->hours: × 24), with the model's own
sampler or, with --ar, greedy left-to-right decoding of the same weights (the encoder as an LM: what the AR loss
trained). The table of 2026-11-27-cpu-assistant.md §9:
python benchmarks/chat_probe/eval_conv.py MODEL ROWS [--ar]
Rows whose answers show the working (make_conv.py --work) are scored on the whole answer and, as "final:", on its
last number alone."""
import collections, json, re, sys
import torch
import blockpress
from blockpress.train.ar import greedy_until

torch.set_num_threads(1)
ar = "--ar" in sys.argv
model, path = [a for a in sys.argv[1:] if a != "--ar"]
lm = blockpress.load(model, progress=False)
tok = lm.tokenizer
rows = [json.loads(line) for line in open(path)]
stops = [tok.token_to_id(t) for t in ["<turn|>", "<eos>"]]
prompts = [tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=True) for r in rows]
if ar:
    new = [greedy_until(lm.module, p, 128, set(stops), lm.device) for p in prompts]
else:
    new = []
    for b in range(0, len(rows), 50):
        res = lm.generate(prompts[b:b + 50], max_new_tokens=128, eos_token_id=stops,
                          generator=torch.Generator().manual_seed(b))
        new += [[t for t in ids if t != 0] for ids in res.new_tokens.tolist()]
by = collections.defaultdict(lambda: [0, 0])
for r, ids in zip(rows, new):
    text = tok.decode([t for t in ids if t not in stops]).strip()
    want = r["messages"][-1]["content"]  # "16 days = 384 hours." (or with the working between)
    words = want.rstrip(".").split()
    exact, final = text.startswith(want), re.findall(r"\d+", text)[-1:] == re.findall(r"\d+", want)[-1:]
    for key, ok in ((f"{words[1]}->{words[-1]}", exact), ("all", exact), ("final", final)):
        by[key][0] += ok
        by[key][1] += 1
print("AR" if ar else "diffusion", model, " ".join(f"{k}:{v[0]}/{v[1]}" for k, v in sorted(by.items())))
