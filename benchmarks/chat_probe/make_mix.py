"""An arithmetic- and conversion-heavy chat mix for fine-tuning the chat model (issue 32 probe).

    python benchmarks/chat_probe/make_mix.py N OUT SEED [SHARE]

SHARE (default 0.6) of the N conversations are `skill` conversations whose question is arithmetic (1-2 digit
add/sub/mul weighted up) or a unit conversion, in the full chat format (system turns, thinking on/off, earlier
exchanges, tools that do not fit); the rest is the normal stream (`assistant.train_dialogs`). Questions of the
held-out set are redrawn, as in the normal stream."""

import json
import random
import sys

from blockpress.tasks import assistant
from blockpress.tasks.assistant import dialogs, skills

n, out, seed = int(sys.argv[1]), sys.argv[2], sys.argv[3]
share = float(sys.argv[4]) if len(sys.argv) > 4 else 0.6
exclude = assistant.heldout_keys()
rest = assistant.train_dialogs(n, seed=int(seed), exclude=exclude)
DIGITS = {"add": [(1, 1), (2, 1), (2, 2), (3, 3)], "sub": [(2, 1), (2, 2), (3, 3)], "mul": [(1, 1), (2, 1), (2, 2)]}
with open(out, "w") as f:
    for i in range(n):
        rng = random.Random(f"assistant/mix/{seed}/{i}")
        if rng.random() < share:
            while True:
                if rng.random() < 0.75:
                    op = rng.choice(list(DIGITS))
                    item = skills.arithmetic(rng, op, rng.choice(DIGITS[op]))
                else:
                    item = skills.conversion(rng)
                d = dialogs.conversation(rng, "skill", item)
                if not any(k in exclude for k in d.keys):
                    break
        else:
            d = next(rest)
        f.write(json.dumps(d.row(), ensure_ascii=False) + "\n")
