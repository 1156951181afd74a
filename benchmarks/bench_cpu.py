"""CPU benchmark: the `small` preset on this CPU, blockpress vs transformers 5.23 (and our AR decode).

The `blockpress bench` harness with CPU defaults: fp32, one torch thread (steadier when the machine
is shared; pass --threads N to change), batch 1 and 2, fixed 16 steps, median of 3 timed runs, exact and fused ("fast")
sampler. Prints one table per sampler and ends with ONE JSON line holding both runs.

    python benchmarks/bench_cpu.py                       # the dated reports in benchmarks/results/
    python benchmarks/bench_cpu.py --preset tiny --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys

from blockpress.cli.bench import add_parser
from blockpress.lab.bench import print_table, run

CPU_DEFAULTS = dict(preset="small", device="cpu", dtype="fp32", threads=1, batch="1,2", modes="fixed", repeats=3,
                    reference_batch="1,2", ar_batch="1")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_parser(parser)
    parser.add_argument("--samplers", default="exact,fast", help="run the harness once per sampler")
    parser.set_defaults(**CPU_DEFAULTS)
    args = parser.parse_args(argv)
    results = []
    for i, sampler in enumerate(s for s in args.samplers.split(",") if s):
        args.sampler = sampler
        if i:  # the transformers and AR baselines do not depend on our sampler: run them once
            args.reference, args.ar = False, False
        r = run(args)
        print_table(r["runs"], f"{r['preset']} on {r['hardware']} (fp32, sampler {sampler}, "
                               f"P={r['prompt_tokens']} N={r['new_tokens']} steps={r['steps']})")
        results.append(r)
    line = {"bench": "cpu", "runs": results}
    if len(results) > 1 and results[0]["runs"] and results[1]["runs"]:
        exact, fast = results[0]["runs"][0], results[1]["runs"][0]
        line["fast_vs_exact_sampler"] = fast["tok_s"] / exact["tok_s"]
    print(json.dumps(line, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
