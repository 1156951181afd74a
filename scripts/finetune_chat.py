"""Second stage of the shipped chat model (blockpress/assets/assistant): a drill-heavy fine-tune of train_chat.py's
model, on CPU.

    python3 scripts/prepare_chat.py --out runs/chat-drill --mix-seed 5 --drill 0.6   # 60 % drills, a fresh mix
    OMP_WAIT_POLICY=PASSIVE python3 scripts/finetune_chat.py --out runs/chat-drill-model  # see the model card

Equivalent to `blockpress train runs/chat-drill/train.jsonl --model runs/chat-model/checkpoint-0007000` with the
recipe below: the same objective as train_chat.py (the encoder's AR loss on at weight 1; without it an earlier
fine-tune lost tool-call validity), from its last checkpoint, on conversations of which 60 % are arithmetic and
conversion drills (45 % in the first stage), drawn with another seed; batch 32, lr 6e-4 with 50 warmup steps,
cosine to 10 %, 2,000 steps. The tokenizer is the first stage's: prepare_chat.py learns it from the same seed
whatever --mix-seed is. Extra flags pass through (e.g. --model, --resume, --steps).
"""

import sys

from blockpress.cli import main

RECIPE = ["train", "runs/chat-drill/train.jsonl", "--model", "runs/chat-model/checkpoint-0007000",
          "--batch-size", "32", "--lr", "6e-4", "--warmup", "50", "--ar-weight", "1", "--steps", "2000",
          "--seed", "5", "--threads", "1", "--eval-data", "runs/chat-drill/heldout.jsonl", "--eval-every", "500",
          "--save-every", "500", "--log-every", "50", "--keep-last", "0", "--no-progress"]

if __name__ == "__main__":
    sys.exit(main(RECIPE + sys.argv[1:]))
