import json, sys, torch, blockpress
from blockpress.train import objective as ob
torch.set_num_threads(1)
lm = blockpress.load(sys.argv[1], progress=False)
tok = lm.tokenizer; m = lm.module
rows = [json.loads(l) for l in open(sys.argv[2])][:300]
C = 32; eos = tok.token_to_id("<eos>"); V = 1024
cfg = ob.ObjectiveConfig()
torch.manual_seed(0)
ents = []; okr = tot = 0; okc = totc = 0
for r in rows:
    from blockpress.train.data import chat_example
    p, resp = chat_example(tok, r)
    ans = r["messages"][-1]["content"]; eq = ans.index("=")
    pre = tok.encode(ans[:eq + 1], add_special_tokens=False)
    npre = len(pre) if hasattr(pre, "__len__") else len(pre.ids)
    b = ob.collate([(p, resp)], C, 1024, cfg, 0)
    canvas = b.canvas_clean.clone()
    res_pos = [i for i in range(npre, len(resp)) if tok.decode([int(canvas[0, i])]).strip().isdigit()]
    noise_all = len(sys.argv) > 3
    for i in (range(len(resp)) if noise_all else res_pos): canvas[0, i] = torch.randint(0, 1024, ())
    with torch.no_grad():
        _, cache = ob.encoder_pass(m, b, context_only=True)
        cache.crop(b.ctx_len)
        lg = m.decode(canvas, cache)
        sc = lg
        lg = m.decode(canvas, cache, sc_logits=sc, sc_mask=torch.ones(1, dtype=torch.bool))
    pred = lg.argmax(-1)[0]
    ent = -(lg[0].softmax(-1) * lg[0].log_softmax(-1)).sum(-1)
    ents.extend(float(ent[i]) for i in res_pos)
    good = all(int(pred[i]) == int(b.canvas_clean[0, i]) for i in res_pos)
    okr += good; tot += 1
print(f"result digits right with everything else clean: {okr}/{tot}")
import statistics; print('mean entropy at result digits', statistics.mean(ents))
