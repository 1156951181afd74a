"""Train the shipped text model (blockpress/assets/kjv) from scratch on CPU.

    sudo apt-get install bible-kjv                           # the public-domain KJV text + its reader
    python3 scripts/prepare_kjv.py --out runs/kjv            # passages, held-out split, BPE tokenizer
    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_kjv.py --out runs/kjv-model     # 2 cores: ~66 min

Equivalent to `blockpress train runs/kjv/train.txt` with the recipe below: the `micro` size (hidden 128,
4 layers, 4 experts top-2) over the 2,048-id byte-level BPE vocabulary, canvas 32, sliding window
covering a 128-token context; each passage's first 1-24 tokens (drawn once per passage) are its
prompt, the rest its response; one sampled canvas per example (Google's way), batch 32, lr 2e-3,
warmup 100, cosine to 10 %, clip 1.0, self-conditioning p 0.5, the encoder's AR loss off (the encoder
then encodes only the context). The held-out passages give the eval loss. Extra flags pass through
(e.g. --resume, --threads).
"""

import sys

from blockpress.cli import main

RECIPE = ["train", "runs/kjv/train.txt", "--tokenizer", "runs/kjv/tokenizer", "--size", "micro",
          "--canvas-length", "32", "--context", "128", "--prompt-tokens", "1", "24", "--batch-size", "32",
          "--lr", "2e-3", "--warmup", "100", "--ar-weight", "0", "--steps", "4000", "--threads", "2",
          "--eval-data", "runs/kjv/heldout.txt", "--eval-every", "250", "--save-every", "100", "--log-every", "20"]

if __name__ == "__main__":
    sys.exit(main(RECIPE + sys.argv[1:]))
