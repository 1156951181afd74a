import json, sys, torch, blockpress
from blockpress.train.ar import greedy_until
torch.set_num_threads(1)
lm = blockpress.load(sys.argv[1], progress=False); tok = lm.tokenizer
rows = [json.loads(l) for l in open(sys.argv[2])][:int(sys.argv[3])]
stops = {tok.token_to_id("<turn|>"), tok.token_to_id("<eos>")}
ok = 0; bad = []
for r in rows:
    p = tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, tokenize=True)
    out = greedy_until(lm.module, p, 24, stops, lm.device)
    txt = tok.decode([t for t in out if t not in stops]).strip(); want = r["messages"][-1]["content"]
    if txt.startswith(want): ok += 1
    elif len(bad) < 4: bad.append((r["messages"][-2]["content"], txt, want))
print(f"AR exact {ok}/{len(rows)}"); [print(b) for b in bad]
