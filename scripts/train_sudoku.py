"""Train the shipped Sudoku model (or its autoregressive baseline) from scratch on CPU.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_sudoku.py --out runs/sudoku-diffusion
    OMP_WAIT_POLICY=PASSIVE python3 scripts/train_sudoku.py --out runs/sudoku-ar --ar-only --steps N

Equivalent to `blockpress train sudoku` with the recipe below (spec training.md §7.2 sizes: hidden 128,
4 layers, 4 experts top-2, sliding window >= prompt + canvas; batch 32, lr 2e-3, warmup 50, cosine to
10%, clip 1.0, self-conditioning p 0.5). The encoder's AR loss is off (weight 0; §7.1 found it does not
help this task), which lets the encoder skip the clean canvas. Puzzles are fresh unique-solution grids
with 30-56 blanks, never a held-out solution. Extra flags are passed through (e.g. --steps, --resume,
--threads); a killed run continues with --resume and gives the same next loss.
"""

import sys

from blockpress.cli import main

RECIPE = ["train", "sudoku", "--size", "micro", "--steps", "4000", "--batch-size", "32", "--lr", "2e-3",
          "--warmup", "50", "--blanks", "30", "56", "--ar-weight", "0", "--eval-every", "100",
          "--save-every", "100", "--log-every", "20", "--threads", "2"]

if __name__ == "__main__":
    sys.exit(main(RECIPE + sys.argv[1:]))
