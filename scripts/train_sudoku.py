"""Train the shipped Sudoku model (or its autoregressive baseline) from scratch on CPU.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_sudoku.py --out runs/sudoku-diffusion
    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_sudoku.py --out runs/sudoku-ar --ar-only

Equivalent to `blockpress train sudoku` with the recipe below (spec training.md §7.2: hidden 128, 4 layers,
4 experts top-2, sliding window >= prompt + canvas, batch 32, lr 2e-3, warmup 50, cosine, clip 1.0,
SC p 0.5, AR weight 1.0). Extra flags are passed through (e.g. --steps, --resume, --threads).
Killed runs continue with --resume (the same next loss).
"""

import sys

from blockpress.cli import main

RECIPE = ["train", "sudoku", "--size", "micro", "--steps", "1800", "--batch-size", "32", "--lr", "2e-3",
          "--warmup", "50", "--blanks", "30", "56", "--eval-every", "100", "--save-every", "100",
          "--save-minutes", "5", "--log-every", "10", "--threads", "1", "--no-progress"]

if __name__ == "__main__":
    sys.exit(main(RECIPE + sys.argv[1:]))
