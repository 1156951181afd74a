"""Alone against batched: the shipped chat model's replies to N validation conversations, each generated alone with
seed i and again in batches of 8 with the same per-row seeds; prints how many differ. README's concurrency note:
python benchmarks/chat_probe/batch_invariance.py grouped 96   (the experts backend: grouped, dense or loop)"""
import sys
import time

import torch

import blockpress
from blockpress.tasks import assistant
torch.set_num_threads(1)
ex, n = sys.argv[1], int(sys.argv[2])
lm = blockpress.load("assistant", progress=False, experts=ex)
ds = assistant.heldout(40, assistant.VAL_SEED)
ds = ds[::max(1, len(ds) // n)][:n]
prompts = [lm.encode_chat(d.messages, enable_thinking=d.thinking, tools=d.tools) for d in ds]
t = time.time()
alone = [lm.decode_new(lm.generate([p], generator=[torch.Generator().manual_seed(i)])) for i, p in enumerate(prompts)]
t1 = time.time() - t; t = time.time()
diff = 0
for s in range(0, n, 8):
    both = lm.generate(prompts[s:s + 8], generator=[torch.Generator().manual_seed(i) for i in range(s, min(s + 8, n))])
    for j in range(both.new_tokens.shape[0]):
        diff += lm.decode_new(both, j) != alone[s + j]
print(ex, "differ", diff, "of", n, f"alone {t1:.1f}s batched {time.time()-t:.1f}s")
