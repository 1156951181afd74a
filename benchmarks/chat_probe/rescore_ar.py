"""The autoregressive column of a new chat eval, from a published eval's replies re-scored by the current scorer:
the AR baseline (`scripts/train_chat.py --ar-only`, runs/chat-ar) is not shipped, and its greedy replies do not
depend on the diffusion model. Checks that no AR reply to a conversation offering no tool opens a call, so a run
with the eval's call ban (`parsing.call_ban`) would give the same replies. Strata added since the published run
(small talk) have no AR replies: their rows stay out of this column.
python benchmarks/chat_probe/rescore_ar.py NEW.json [PUBLISHED, default benchmarks/results/assistant-eval.json]"""
import json
import sys

from blockpress.parsing import CALL_OPEN
from blockpress.tasks import assistant
from blockpress.tasks.assistant import evaluate as ev

new_path = sys.argv[1]
old_path = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/results/assistant-eval.json"
col = "autoregressive (greedy)"
old = json.load(open(old_path))[col]
new = json.load(open(new_path))
per = len(new["diffusion, default sampler"]["cases"]) // len(assistant.strata())  # conversations per stratum
texts = [c["text"] for c in old["cases"]]
# the published replies cover the strata there were then: the first ones (a stratum is appended, never inserted;
# the small-talk stratum came after the AR baseline, which is not on this machine, so its row stays empty)
dialogs = assistant.heldout(per)[:len(texts)]
assert len(texts) % per == 0 and [c["row"] for c in old["cases"]] == [d.expect["row"] for d in dialogs]
assert not any(CALL_OPEN in t for d, t in zip(dialogs, texts) if not d.tools), "an AR reply calls an unoffered tool"
r = ev.summarize(dialogs, texts)
r["seconds"] = old["seconds"]
r["summary"] = {row: round(100 * h[0] / h[1], 1) for row, h in r["rows"].items()}
new[col] = r
with open(new_path, "w") as f:
    json.dump(new, f, indent=1)
print(json.dumps({col: r["summary"]}))
