"""Generation benchmark: blockpress vs transformers 5.23 vs our own AR decode, in one process.

Same harness as `blockpress bench` (blockpress/cli/bench.py); see benchmarks/README.md.

    python benchmarks/bench_generate.py --preset tiny --new-tokens 32            # CI, CPU, seconds
    python benchmarks/bench_generate.py --preset real-26b --batch 1,2,4,8         # H100 / H200, bf16
    python benchmarks/bench_generate.py --preset real-26b --precision fp8 --no-reference
"""

import sys

from blockpress.cli.bench import main_argv

if __name__ == "__main__":
    sys.exit(main_argv())
