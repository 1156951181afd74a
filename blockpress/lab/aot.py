"""Compile the Triton kernels for a CUDA GPU on a machine without one (ahead of time; nothing is launched).

Job: catch what Triton's CPU interpreter cannot. The interpreter runs the kernels' Python semantics (with
fp32 dots and no libdevice, see the launchers' `interpreted()` branches); it never builds the code a GPU
runs. Here every kernel goes through Triton's real pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas cubin)
for a chosen architecture, and the result is read back: does it compile, would it launch (shared memory
within the card's limit, registers for every thread of a block), does it spill, how wide are its global
loads, which tensor-core instruction did its dots become, how many instructions is it.

How: Triton compiles for any `GPUTarget("cuda", arch, 32)` with the ptxas its wheel ships; only the
launch needs a driver. `compile_only(arch)` puts a stand-in driver in front of Triton and turns every
`kernel[grid](...)` into a compile with those arguments' specialisation and no launch. The launchers of
blockpress then run unchanged on CPU tensors of the real shapes (`torch.empty`: untouched pages cost no
memory), so the variants compiled are the ones a GPU run of the same shapes would compile.

Invariant: TRITON_INTERPRET must be "0" when `triton.jit` wraps the kernels, i.e. before blockpress's
kernel modules are first imported; a process that already imported them in interpreter mode (a test
process) must run this in a subprocess (`benchmarks/compile_report.py` is that process).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

REGS_PER_SM = 65536
# (cards, max dynamic shared memory per block, shared memory per SM, resident warps per SM) by compute capability
ARCHS = {
    80: ("A100", 166912, 167936, 64),
    86: ("RTX 30xx / A10", 101376, 102400, 48),
    89: ("RTX 40xx / L4 / L40", 101376, 102400, 48),
    90: ("H100 / H200", 232448, 233472, 64),
    120: ("RTX 50xx", 101376, 131072, 48),
}


@dataclass
class Compiled:
    """One compiled kernel variant, read back from its PTX and cubin."""

    kernel: str
    label: str  # what the launcher was asked to do (the caller's words)
    arch: int
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0  # bytes of shared memory per block (Triton's count, what the launch asks for)
    regs: int = 0
    spill: int = 0  # bytes of local memory per thread: its stack frame (where ptxas spills registers) and LOCAL
    loads: dict = field(default_factory=dict)  # global load width in bytes -> count (ld.global and cp.async)
    async_loads: dict = field(default_factory=dict)  # the cp.async part of `loads`: copies into shared memory that
    # Triton's pipeliner issues stages ahead; an ld.global is waited for in the iteration that issues it
    loop_plain_loads: dict = field(default_factory=dict)  # ld.global widths inside the largest PTX loop (per iteration)
    mma: str = "none"  # wgmma (Hopper warpgroup MMA), mma.sync (Ampere-style) or none
    sass: int = 0  # static instruction count
    loop: int = 0  # instructions in its largest loop body (a K-tile iteration of the matmul kernels), 0 if none
    error: str = ""  # why it did not compile: the root cause's message ("" when it compiled)

    def problems(self) -> list[str]:
        """Why this variant would not launch on the architecture (empty when it would)."""
        if self.error:
            return [f"does not compile: {self.error}"]
        _, smem_block, _, _ = ARCHS.get(self.arch, ARCHS[90])
        out = []
        if self.shared > smem_block:
            out.append(f"needs {self.shared} B of shared memory, sm_{self.arch} allows {smem_block} per block")
        if self.regs * 32 * self.num_warps > REGS_PER_SM:
            out.append(f"{self.regs} registers x {32 * self.num_warps} threads exceed {REGS_PER_SM} per block")
        return out

    def blocks_per_sm(self) -> int:
        """Resident blocks per SM, limited by registers, shared memory and warps (0: will not launch)."""
        if self.error or self.num_warps == 0:
            return 0
        _, smem_block, smem_sm, warps_sm = ARCHS.get(self.arch, ARCHS[90])
        regs_per_warp = -(-max(self.regs, 1) * 32 // 256) * 256  # registers are allocated 256 per warp
        by_regs = REGS_PER_SM // (regs_per_warp * self.num_warps)
        by_smem = smem_sm // self.shared if self.shared else 1 << 30
        by_warps = warps_sm // self.num_warps
        return 0 if self.problems() else min(by_regs, by_smem, by_warps)

    def row(self) -> dict:
        d = asdict(self)
        d["blocks_per_sm"] = self.blocks_per_sm()
        d["problems"] = self.problems()
        return d


class _StandInDriver:
    """What `JITFunction.run(..., warmup=True)` asks of a driver, for a GPU that is not there."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.arch, self.target = arch, GPUTarget("cuda", arch, 32)

    def get_current_device(self):  # a JITFunction keeps its compiled kernels (and target) per device: one per arch
        return -self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    @property
    def utils(self):  # what launchers ask of the device (moe_grouped._smem_limit)
        smem = ARCHS.get(self.arch, ARCHS[90])[1]
        return type("Utils", (), {"get_device_properties": staticmethod(lambda device: {"max_shared_mem": smem})})


@contextmanager
def compile_only(arch: int):
    """Inside: every `kernel[grid](...)` compiles for sm_`arch` instead of launching. Yields a list that gets
    (kernel name, compiled kernel or exception) per launch attempted."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_only needs TRITON_INTERPRET=0 before the kernels are imported; run it in a "
                           "process of its own (benchmarks/compile_report.py)")
    from triton.runtime.driver import driver
    from triton.runtime.jit import KernelInterface

    got: list = []

    def getitem(self, grid):
        def launch(*args, **kwargs):
            try:
                got.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kwargs)))
            except Exception as e:  # a compile error is a result here, not a crash
                got.append((self.fn.__name__, e))
        return launch

    saved, saved_driver = KernelInterface.__getitem__, driver._active  # _active: None on a machine without CUDA
    driver.set_active(_StandInDriver(arch))
    KernelInterface.__getitem__ = getitem
    try:
        yield got
    finally:
        KernelInterface.__getitem__ = saved
        driver._active = saved_driver


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)")
_LD = re.compile(r"\bld\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bsuf](8|16|32|64)\b")
_CP = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)")


def read_back(name: str, kernel, label: str, arch: int) -> Compiled:
    """A compiled Triton kernel -> Compiled (resource usage from its cubin, loads and MMA from its PTX)."""
    c = Compiled(kernel=name, label=label, arch=arch)
    if isinstance(kernel, Exception):
        while kernel.__cause__ is not None:  # Triton chains a CompilationError per call level: the root says why
            kernel = kernel.__cause__
        lines = [ln for ln in str(kernel).strip().splitlines() if ln.strip() and ln.strip() != "^"]
        c.error = f"{type(kernel).__name__}: {lines[-1] if lines else ''}"[:300]
        return c
    md = kernel.metadata
    c.num_warps, c.num_stages, c.shared = md.num_warps, md.num_stages, md.shared
    m = _RES.search(_cuobjdump(kernel.asm["cubin"], "-res-usage"))
    if m:
        c.regs, c.spill = int(m.group(1)), int(m.group(2)) + int(m.group(3))  # cuobjdump -res-usage's STACK + LOCAL
    ptx = kernel.asm["ptx"]
    widths: collections.Counter = collections.Counter()
    async_widths: collections.Counter = collections.Counter()
    for vec, bits in _LD.findall(ptx):
        widths[str(int(vec or 1) * int(bits) // 8)] += 1
    for size in _CP.findall(ptx):
        widths[str(int(size, 0))] += 1
        async_widths[str(int(size, 0))] += 1
    c.loads = dict(sorted(widths.items(), key=lambda kv: int(kv[0])))
    c.async_loads = dict(sorted(async_widths.items(), key=lambda kv: int(kv[0])))
    c.loop_plain_loads = ptx_loop_loads(ptx)
    c.mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    c.sass, c.loop = sass_counts(_cuobjdump(kernel.asm["cubin"], "-sass"))
    return c


def ptx_loop_loads(ptx: str) -> dict:
    """Widths (bytes -> count) of the ld.global instructions inside the PTX's largest loop: from a label LLVM marks
    as a loop header to the last branch back to it. These loads are not pipelined: each iteration issues them and
    waits for them (a matmul's K-tile loop should have only small ones, like the int4 scales)."""
    lines = ptx.splitlines()
    best: list[str] = []
    for i, line in enumerate(lines):
        if "Loop Header" not in line:
            continue
        # the label is on the header's line, or on the line before when it carries a comment of its own
        m = re.match(r"\s*(\$L\w+):", line) or (re.match(r"\s*(\$L\w+):", lines[i - 1]) if i else None)
        if not m:
            continue
        back = [j for j in range(i + 1, len(lines)) if re.search(r"\bbra(?:\.uni)?\s+" + re.escape(m.group(1)) + ";",
                                                                  lines[j])]
        if back and back[-1] - i > len(best):
            best = lines[i:back[-1] + 1]
    widths: collections.Counter = collections.Counter()
    for vec, bits in _LD.findall("\n".join(best)):
        widths[str(int(vec or 1) * int(bits) // 8)] += 1
    return dict(sorted(widths.items(), key=lambda kv: int(kv[0])))


_SASS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def sass_counts(sass: str) -> tuple[int, int]:
    """(instructions, instructions of the largest loop body: from a backward branch's target to the branch)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS.match, sass.splitlines()) if m]
    loop = 0
    for addr, text in ins:
        if not re.search(r"\bBRA\b", text):  # `BRA 0x..`, `@P0 BRA 0x..`, Blackwell's `BRA.U !UP0, 0x..`
            continue
        target = int(re.findall(r"0x([0-9a-f]+)", text)[-1], 16)
        if target < addr:
            loop = max(loop, sum(1 for a, _ in ins if target <= a <= addr))
    return len(ins), loop
