import json, sys, torch, blockpress
torch.set_num_threads(1)
lm = blockpress.load(sys.argv[1], progress=False)
tok = lm.tokenizer
rows = [json.loads(l) for l in open(sys.argv[2])][:int(sys.argv[3]) if len(sys.argv) > 3 else 200]
stops = [tok.token_to_id(t) for t in ["<turn|>", "<eos>"] if tok.token_to_id(t) is not None]
prompts = [tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=True) for r in rows]
ok = 0; bad = []
steps = int(sys.argv[4]) if len(sys.argv) > 4 else None
kw = dict(max_denoising_steps=steps, stability_threshold=None) if steps else {}
for b in range(0, len(rows), 50):
    res = lm.generate(prompts[b:b+50], max_new_tokens=32, eos_token_id=stops, generator=torch.Generator().manual_seed(b), **kw)
    for j, r in enumerate(rows[b:b+50]):
        ids = [t for t in res.new_tokens[j].tolist() if t != 0]
        txt = tok.decode([t for t in ids if t not in stops]).strip()
        want = r["messages"][-1]["content"]
        if txt.startswith(want): ok += 1
        elif len(bad) < 8: bad.append((r["messages"][-2]["content"], txt[:40], want))
print(f"exact {ok}/{len(rows)}"); [print(x) for x in bad]
