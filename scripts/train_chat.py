"""Train the shipped chat model (blockpress/assets/assistant) from scratch on CPU.

    python3 scripts/prepare_chat.py --out runs/chat                          # conversations, held-out split, BPE
    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_chat.py --out runs/chat-model    # see the model card for the time
    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_chat.py --out runs/chat-ar --ar-only   # the AR baseline

Equivalent to `blockpress train runs/chat/train.jsonl` with the recipe below: the `micro` size (hidden 128,
4 layers, 4 experts top-2) over the 1,024-id BPE of prepare_chat.py, canvas 32 (most answers fit one canvas,
a thinking turn takes two or three), sliding window covering a 384-token context (the longest prompt, tool
declarations and earlier turns included, is ~270 tokens); each row's final assistant turn is the response
(thought channel, content, tool calls and the stop token, as the model writes them), batches of similar
lengths (`ChatJsonlSource` buckets); batch 32, lr 2e-3, warmup 100, cosine to 10 %, clip 1.0,
self-conditioning p 0.5, the encoder's next-token (AR) loss at weight 1 (the shared weights also learn to predict
the conversation left to right, which teaches them the sums about 3x faster per step). The held-out
conversations give the eval loss. Extra flags pass through (e.g. --resume, --steps, --ar-only).
"""

import sys

from blockpress.cli import main

RECIPE = ["train", "runs/chat/train.jsonl", "--tokenizer", "runs/chat/tokenizer", "--size", "micro",
          "--canvas-length", "32", "--context", "384", "--batch-size", "32", "--lr", "2e-3", "--warmup", "100",
          "--ar-weight", "1", "--steps", "7000", "--threads", "1", "--eval-data", "runs/chat/heldout.jsonl",
          "--eval-every", "500", "--save-every", "500", "--log-every", "50", "--keep-last", "0", "--no-progress"]

if __name__ == "__main__":
    sys.exit(main(RECIPE + sys.argv[1:]))
