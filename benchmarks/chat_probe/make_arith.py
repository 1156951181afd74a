import json, random, sys
from blockpress.tasks.assistant import skills
n = int(sys.argv[1]); out = sys.argv[2]; seed = sys.argv[3]
rng = random.Random(seed)
with open(out, "w") as f:
    for i in range(n):
        op = rng.choice(["add", "sub"])
        d = rng.choice([(1, 1), (2, 1), (2, 2)])
        it = skills.arithmetic(rng, op, d)
        f.write(json.dumps({"messages": [{"role": "user", "content": it.question}, {"role": "assistant", "content": it.answer}]}) + "\n")
