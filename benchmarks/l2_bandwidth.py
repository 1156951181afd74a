"""L2 -> SM read bandwidth against device-memory bandwidth, measured by one Triton kernel on two buffer sizes.

Why: `compile_report.py`'s issue model counts the bytes the expert kernels read from L2 (every N tile re-reads
its M block's activations): at batch 1 the int4 experts read ~16 GB a step from L2 against 12 GB from HBM, at
batch 4 ~28 GB. Whether that matters depends on how much faster L2 is than HBM on the card, which no datasheet
gives. This measures it.

How: each program of `_reread_kernel` sums REPS chunks of a buffer, chunk (pid + r * STRIDE) mod n_chunks, with
`.cg` loads (L2, not L1), so every chunk is read by many programs on different SMs. A buffer well inside L2
(default 16 MB) gives the L2 rate; one far outside it (default 2 GB) gives the device-memory rate of the same
access pattern. Bytes counted: programs x REPS x chunk bytes (the small output left out). The sums are checked
against torch, so a kernel that skipped its reads would fail, not look fast.

    python benchmarks/l2_bandwidth.py            # on a GPU: ~10 s; ends with a JSON line
    python benchmarks/l2_bandwidth.py --device cpu --l2-mb 1 --dram-mb 4 --reps 4   # the interpreter (a check)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from blockpress.cli.run import _positive_int  # noqa: E402
from blockpress.kernels._triton import tl, triton, usable_on  # noqa: E402
from blockpress.lab.profile import time_ms  # noqa: E402

CHUNK = 4096  # fp32 elements per load (16 KB): 32 per thread at 4 warps, 16-byte vector loads
STRIDE = 7919  # a prime: consecutive reads of one program land on chunks far apart, on other SMs' recent reads

if triton is not None:

    @triton.jit
    def _reread_kernel(x_ptr, out_ptr, n_chunks, REPS: tl.constexpr, CHUNK: tl.constexpr, STRIDE: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, CHUNK)
        acc = tl.zeros((CHUNK,), tl.float32)
        for r in range(REPS):
            c = (pid + r * STRIDE) % n_chunks
            acc += tl.load(x_ptr + c.to(tl.int64) * CHUNK + offs, cache_modifier=".cg")
        tl.store(out_ptr + pid.to(tl.int64) * CHUNK + offs, acc)


def reread(x: torch.Tensor, programs: int, reps: int) -> torch.Tensor:
    """out [programs, CHUNK]: program p's sum of chunks (p + r * STRIDE) mod n_chunks, r < reps."""
    n_chunks = x.numel() // CHUNK
    out = torch.empty(programs, CHUNK, dtype=torch.float32, device=x.device)
    _reread_kernel[(programs,)](x, out, n_chunks, REPS=reps, CHUNK=CHUNK, STRIDE=STRIDE)
    return out


def reread_reference(x: torch.Tensor, programs: int, reps: int) -> torch.Tensor:
    chunks = x.view(-1, CHUNK)
    p = torch.arange(programs, device=x.device)[:, None]
    idx = (p + torch.arange(reps, device=x.device)[None, :] * STRIDE) % chunks.shape[0]  # [programs, reps]
    return chunks[idx].sum(1)


def measure(mb: int, programs: int, reps: int, device: torch.device, repeats: int) -> dict:
    x = torch.randn(mb * 2 ** 20 // 4 // CHUNK * CHUNK, device=device)
    got = reread(x, programs, reps)
    ref = reread_reference(x, programs, reps)
    err = float((got - ref).norm() / ref.norm())
    ms = time_ms(lambda: reread(x, programs, reps), device, repeats)
    read = programs * reps * CHUNK * 4
    return {"buffer_mb": mb, "programs": programs, "reps": reps, "bytes_read": read, "ms": ms,
            "gbs": read / ms / 1e6, "rel_err": err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None)
    p.add_argument("--l2-mb", type=_positive_int, default=16, help="a buffer well inside L2 (H100/H200: 50 MB)")
    p.add_argument("--dram-mb", type=_positive_int, default=2048, help="a buffer far outside L2")
    p.add_argument("--programs", type=_positive_int, default=None, help="default: 8 per SM (GPU), 8 (CPU)")
    p.add_argument("--reps", type=_positive_int, default=64, help="chunks each program reads")
    p.add_argument("--repeats", type=_positive_int, default=3, help="CPU: timed calls (best taken)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if triton is None or not usable_on(device):
        print("l2_bandwidth: error: needs Triton on this device (CUDA, or TRITON_INTERPRET=1 on a CPU)",
              file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    programs = args.programs or 8 * sms
    rows = [measure(mb, programs, args.reps, device, args.repeats) for mb in (args.l2_mb, args.dram_mb)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"{name}: {programs} programs x {args.reps} reads of {CHUNK * 4 // 1024} KB chunks (.cg loads)")
    for r, what in zip(rows, ("L2", "device memory")):
        print(f"  {r['buffer_mb']:>6} MB buffer ({what:>13}): {r['gbs']:9.4g} GB/s  ({r['ms']:.3f} ms, "
              f"rel. err {r['rel_err']:.1e})")
    ratio = rows[0]["gbs"] / rows[1]["gbs"]
    print(f"  L2 / device memory: {ratio:.2f}x")
    ok = all(r["rel_err"] < 1e-5 for r in rows)
    print(json.dumps({"bench": "l2_bandwidth", "device": name, "ok": ok, "l2": rows[0], "dram": rows[1],
                      "l2_over_dram": ratio}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
