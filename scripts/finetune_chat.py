"""The fine-tunes of the shipped chat model (blockpress/assets/assistant): drill-heavy stages after train_chat.py's
model, on CPU.

    python3 scripts/prepare_chat.py --out runs/chat-drill --mix-seed 5 --drill 0.6    # stage 1's mix: 60 % drills
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 1 --out runs/chat-drill-model
    python3 scripts/prepare_chat.py --out runs/chat-drill2 --mix-seed 6 --drill 0.7   # stage 2's mix: 70 % drills
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 2 --out runs/chat-drill2-model
    python3 scripts/prepare_chat.py --out runs/chat-goals --mix-seed 7 --drill 0.75 --drills goals --n 110000
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 3 --out runs/chat-goals-model  # the shipped one
    python3 scripts/prepare_chat.py --out runs/chat-goals8 --mix-seed 8 --drill 0.75 --drills goals --n 110000
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 4 --out runs/chat-deep-model
    python3 scripts/prepare_chat.py --out runs/chat-conv --mix-seed 9 --drill 0.75 --drills conversions --n 70000
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 5 --out runs/chat-conv-model
    python3 scripts/prepare_chat.py --out runs/chat-steps --mix-seed 10 --drill 0.75 --drills factors --n 56000 \
        --conversion-working steps
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 6 --out runs/chat-steps-model
    python3 scripts/prepare_chat.py --out runs/chat-method --mix-seed 10 --drill 0.75 --drills factors --n 56000 \
        --conversion-working method
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 7 --out runs/chat-method-model
    python3 scripts/prepare_chat.py --out runs/chat-method2 --mix-seed 11 --drill 0.75 --drills goals --n 40000 \
        --conversion-working method
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 8 --out runs/chat-method2-model
    python3 scripts/prepare_chat.py --out runs/chat-steps2 --mix-seed 12 --drill 0.75 --drills factors --n 56000 \
        --conversion-working steps --holdout-val
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 9 --out runs/chat-steps2-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-wide --mix-seed 13 --drill 0.75 --drills wide --n 96000 --holdout-val
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 10 --out runs/chat-wide-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-digits --mix-seed 14 --drill 0.75 --drills wide --n 96000 \
        --holdout-val --conversion-working digits
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 11 --out runs/chat-digits-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-products --mix-seed 15 --drill 0.85 --drills products --n 64000 \
        --holdout-val --conversion-working digits
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 12 --out runs/chat-products-model
    python3 scripts/prepare_chat.py --out runs/chat-products2 --mix-seed 16 --drill 0.85 --drills products --n 64000 \
        --holdout-val --conversion-working digits
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 13 --out runs/chat-products2-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-balance --mix-seed 17 --n 24000 --holdout-val \
        --conversion-working digits
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 14 --out runs/chat-balance-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-tables --mix-seed 18 --drill 0.75 --drills tables --n 48000 \
        --holdout-val --teach-tables
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 15 --out runs/chat-tables-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-tables2 --mix-seed 19 --drill 0.75 --drills tables-tools \
        --n 48000 --holdout-val --teach-tables
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 16 --out runs/chat-tables2-model --threads 2
    python3 scripts/finetune_chat.py --stage 17 --out runs/chat-soup    # the mean of 15 and 16: the shipped model
    python3 scripts/prepare_chat.py --out runs/chat-sub --mix-seed 20 --drill 0.75 --drills subtraction --n 48000 \
        --holdout-val --teach-tables
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 18 --out runs/chat-sub-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-refuse --mix-seed 21 --drill 0.75 --drills refusals --n 48000 \
        --holdout-val --teach-tables
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 19 --out runs/chat-refuse-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-sub2 --mix-seed 22 --drill 0.75 --drills subtraction --n 48000 \
        --holdout-val --teach-tables --sub-working zeros
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 20 --out runs/chat-sub2-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-subref --mix-seed 23 --drill 0.75 --drills sub-refusals \
        --n 48000 --holdout-val --teach-tables --sub-working zeros
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 23 --out runs/chat-subref-model --threads 2
    python3 scripts/finetune_chat.py --stage 24 --out runs/chat-soup24
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 25 --out runs/chat-soup24-sub --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-talk --mix-seed 26 --drill 0.75 --drills smalltalk --n 48000 \
        --holdout-val --teach-tables --sub-working zeros
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 26 --out runs/chat-talk-model --threads 2
    python3 scripts/prepare_chat.py --out runs/chat-talk2 --mix-seed 27 --drill 0.75 --drills smalltalk-more \
        --n 48000 --holdout-val --teach-tables --sub-working zeros
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 27 --out runs/chat-talk2-model --threads 2
    python3 scripts/finetune_chat.py --stage 28 --out runs/chat-soup28    # the mean of stage 20 (shipped then) and 27
    python3 scripts/prepare_chat.py --out runs/chat-dialogue --mix-seed 29 --drill 0.75 --drills smalltalk-more \
        --n 26000 --holdout-val --teach-tables --sub-working zeros --history 4
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --stage 29 --out runs/chat-dialogue-model --threads 2

Stages 4 to 10 are experiments toward the conversions goal; none beat stage 3 on unseen questions, so none is shipped
(benchmarks/results/2026-11-27-cpu-assistant.md §7 to §9). Stage 4 first grows stage 3's model to 8 layers
(`blockpress.train.grow.grow_depth` into runs/chat-deep-init: the 4 trained layers, then a copy of them that
starts as the identity), so the deeper model begins where the shallow one ended: conversions need 2-digit
multiplication and division, which the 4-layer model did not learn. Stage 5 goes on from stage 3's model (4 layers) on
drills with conversions weighted up and the products by the conversion factors 7, 12, 24 and 60 (`--drills
conversions`). Stages 6 and 7 go on from stage 3's model on drills that weight those conversions up (`--drills factors`), with the conversion workings by 7,
12, 24 and 60 rewritten (`--conversion-working`): stage 6 writes a product as the sums of doublings it is made of
("and 24 = 20 + 4. 16 + 16 = 32. 32 + 32 = 64. 320 + 64 = 384."), stage 7 only names the rule ("so multiply 16 by
24"), so the answer gives the number as it does with thinking off. Stage 8 goes on from stage 7's model on the
goal rows' mix (`--drills goals`, more 2-digit sums than stage 7's) at half the learning rate. Stage 9 gives stage
6's `steps` working 1,500 more steps on a fresh mix that also keeps the validation questions out (`--holdout-val`);
it was stopped at 1,000, with no progress on the test split. Stage 10 goes on from stage 3's model on drills whose
conversions by 7, 12, 24 and 60 draw multipliers up to 99 instead of 30 (`--drills wide`, validation questions kept
out too): more examples of each factor's rule. It was stopped at 2,000 steps, no better on unseen questions (§9).
Stage 11 goes on from stage 3's model on the same drills with the "digits" answers (`--conversion-working digits`):
a product by 7, 12, 24 or 60 is written out from one-digit facts, "16 × 24 = 10 × 24 + 6 × 24 = 240 + 144 = 384",
which let a conversions-only probe answer unseen products (§10). Stage 12 goes on from stage 11's model on a mix
three times as dense in those products (`--drills products`, 85 % drills): stage 11 had seen fewer worked products
in 3,000 steps than the probe in 500 (§11). Stage 13 gives it 1,500 more steps on a fresh mix of the same kind.
Stage 14 goes on from stage 13's model for 600 steps at half the learning rate on the base mix's kind
(prepare_chat.py's defaults: 45 % broad drills; `digits` answers), to win back the 1-digit arithmetic that stages 12
and 13 lost. Stages 15 and 16 go on from stage 3's model with the one-digit facts taught (`--teach-tables`), 16 also
drilling requests no declared tool fits and answers from a tool's response; stage 17 is the mean of their weights
(§12). Stages 18 and 19 go on from stage 17 at half the learning rate: 18 drills 2-digit subtraction, one-digit
differences most (`--drills subtraction`); 19 drills requests whose fitting tool is not declared while others are,
against calls where it is (`--drills refusals`). Stage 20 gives stage 18 1,500 more steps with the subtraction
workings in the "zeros" style (`--sub-working zeros`). Stages 21 and 22 are the means of 18 and 19, and of 20 and 19
(§13). Stage 23 goes on from stage 20 on refusals and subtraction drills together (`--drills sub-refusals`, the
"zeros" working), stage 24 is the mean of 20 and 23, and stage 25 gives stage 24 600 steps of stage 20's mix at lr
1.5e-4 (§14; none is shipped: each cost 2-digit subtraction what it gained in refusals). Stage 26 goes on from stage
20 with small talk in the drills (`--drills smalltalk`: greetings, thanks, questions about the assistant, requests
outside its skills), stage 27 from stage 26 with twice as much (`--drills smalltalk-more`): the shipped model. Stage
28, the mean of 20 and 27, lost the small talk (benchmarks/results/2026-11-28-cpu-chat-smalltalk.md). Stage 29 goes on
from stage 27 (run from the asset it was shipped as) on stage 27's kind of mix whose conversations open with up to four earlier exchanges,
half of them small talk (`--history 4`): every mix before held one at most, and a chat of several turns lost its
replies turn after turn (`benchmarks/chat_probe/dialogue.py`; benchmarks/results/2026-11-29-cpu-chat-history.md). Its
checkpoint at step 400 is the shipped model.

Each is `blockpress train MIX/train.jsonl --model PREVIOUS` with the recipe below: the same objective as
train_chat.py (the encoder's AR loss on at weight 1; without it an earlier fine-tune lost tool-call validity), from
the previous stage's last checkpoint, on a fresh mix from the same generator (another seed, more arithmetic and
conversion drills than the first stage's 45 %; stage 3's drills ask only what the eval's goals name: 2-digit
addition and subtraction, conversions, tool calls); batch 32, lr 6e-4 with 50 warmup steps, cosine to 10 %. The
tokenizer is the first stage's: prepare_chat.py learns it from the same seed whatever --mix-seed is. Extra flags
pass through (e.g. --model, --resume, --steps).
"""

import argparse
import sys
from pathlib import Path

from blockpress.cli import main

COMMON = ["--batch-size", "32", "--lr", "6e-4", "--warmup", "50", "--ar-weight", "1", "--threads", "1",
          "--eval-every", "500", "--save-every", "500", "--log-every", "50", "--keep-last", "0", "--no-progress"]
# stage: (the prepare_chat.py mix it trains on, the model it starts from, steps, seed)
STAGES = {
    1: ("runs/chat-drill", "runs/chat-model/checkpoint-0007000", 2000, 5),
    2: ("runs/chat-drill2", "runs/chat-drill-model/checkpoint-0002000", 2500, 6),
    3: ("runs/chat-goals", "runs/chat-drill2-model/checkpoint-0002500", 3000, 7),
    4: ("runs/chat-goals8", "runs/chat-deep-init", 2400, 8),
    5: ("runs/chat-conv", "runs/chat-goals-model/checkpoint-0003000", 2000, 9),
    6: ("runs/chat-steps", "runs/chat-goals-model/checkpoint-0003000", 1500, 10),
    7: ("runs/chat-method", "runs/chat-goals-model/checkpoint-0003000", 1500, 10),
    8: ("runs/chat-method2", "runs/chat-method-model/checkpoint-0001500", 1000, 11),
    9: ("runs/chat-steps2", "runs/chat-steps-model/checkpoint-0001500", 1500, 12),
    10: ("runs/chat-wide", "runs/chat-goals-model/checkpoint-0003000", 3000, 13),
    11: ("runs/chat-digits", "runs/chat-goals-model/checkpoint-0003000", 3000, 14),
    12: ("runs/chat-products", "runs/chat-digits-model/checkpoint-0003000", 1500, 15),
    13: ("runs/chat-products2", "runs/chat-products-model/checkpoint-0001500", 1500, 16),
    14: ("runs/chat-balance", "runs/chat-products2-model/checkpoint-0001500", 600, 17),
    15: ("runs/chat-tables", "runs/chat-goals-model/checkpoint-0003000", 1500, 18),
    16: ("runs/chat-tables2", "runs/chat-goals-model/checkpoint-0003000", 1500, 19),
    18: ("runs/chat-sub", "runs/chat-soup", 1500, 20),
    19: ("runs/chat-refuse", "runs/chat-soup", 1500, 21),
    20: ("runs/chat-sub2", "runs/chat-sub-model/checkpoint-0001500", 1500, 22),
    23: ("runs/chat-subref", "runs/chat-sub2-model/checkpoint-0001500", 1500, 23),
    25: ("runs/chat-sub2", "runs/chat-soup24", 600, 25),
    26: ("runs/chat-talk", "runs/chat-sub2-model/checkpoint-0001500", 800, 26),
    27: ("runs/chat-talk2", "runs/chat-talk-model/checkpoint-0000800", 1500, 27),
    29: ("runs/chat-dialogue", "runs/chat-talk2-model/checkpoint-0001500", 800, 29),  # (run from the asset, which
    # held those weights)
}
OVERRIDES = {8: ["--lr", "3e-4"], 14: ["--lr", "3e-4"], 18: ["--lr", "3e-4"], 19: ["--lr", "3e-4"],
             20: ["--lr", "3e-4"], 23: ["--lr", "3e-4"],
             25: ["--lr", "1.5e-4"], 26: ["--lr", "2e-4", "--save-every", "400"],
             27: ["--lr", "4e-4", "--save-every", "500"],
             29: ["--lr", "2e-4", "--save-every", "400", "--eval-every", "400"]}  # stage: flags in place of COMMON's


def stage_args(stage: int) -> list[str]:
    mix, model, steps, seed = STAGES[stage]
    return [f"{mix}/train.jsonl", "--model", model, "--steps", str(steps), "--seed", str(seed),
            "--eval-data", f"{mix}/heldout.jsonl"]


GROW = {4: ("runs/chat-goals-model/checkpoint-0003000", "runs/chat-deep-init")}  # stage: (source, grown model)
# stage: the checkpoints whose weights it averages (a "model soup": fine-tunes of one model, mixed in weight space);
# the first one's other files (config, tokenizer, template) go with it
SOUPS = {17: ("runs/chat-tables-model/checkpoint-0001500", "runs/chat-tables2-model/checkpoint-0001500"),
         21: ("runs/chat-sub-model/checkpoint-0001500", "runs/chat-refuse-model/checkpoint-0001500"),
         22: ("runs/chat-sub2-model/checkpoint-0001500", "runs/chat-refuse-model/checkpoint-0001500"),
         24: ("runs/chat-sub2-model/checkpoint-0001500", "runs/chat-subref-model/checkpoint-0001500"),
         28: ("runs/chat-sub2-model/checkpoint-0001500", "runs/chat-talk2-model/checkpoint-0001500")}


def soup(sources, out: str) -> None:
    """The mean of the checkpoints' weights (in fp64, stored in their dtype), written to `out`."""
    import shutil

    from safetensors.torch import load_file, save_file

    parts = [load_file(f"{s}/model.safetensors") for s in sources]
    if any(p.keys() != parts[0].keys() for p in parts):
        raise SystemExit(f"the checkpoints {', '.join(sources)} do not hold the same tensors")
    mean = {k: (sum(p[k].double() for p in parts) / len(parts)).to(parts[0][k].dtype) for k in parts[0]}
    Path(out).mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja"):
        shutil.copy(f"{sources[0]}/{f}", f"{out}/{f}")
    save_file(mean, f"{out}/model.safetensors", metadata={"format": "pt"})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--stage", type=int, choices=sorted(STAGES) + sorted(SOUPS), default=3)
    ap.add_argument("--out", default=None)
    known, rest = ap.parse_known_args()
    if known.stage in SOUPS:
        soup(SOUPS[known.stage], known.out or "runs/chat-soup")
        sys.exit(0)
    if known.out:
        rest = ["--out", known.out, *rest]
    if known.stage in GROW and not Path(GROW[known.stage][1]).exists():
        from blockpress.train.grow import grow_depth

        grow_depth(*GROW[known.stage], times=2)
    sys.exit(main(["train", *stage_args(known.stage), *COMMON, *OVERRIDES.get(known.stage, []), *rest]))
