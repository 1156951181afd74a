"""Where a denoising step's time goes: per-kernel device times, grouped, against the bytes each group moves.

`profile_steps` runs one canvas of a generation under torch.profiler and keeps the denoising steps after
the first (no prompt encoding, no commit). It reports, per step:
- wall time (a host sync per step, from the draft events, so the profile does not hide launch gaps);
- kernels launched per step (CUDA; on a CPU, aten ops with time of their own): what CUDA graphs replay one by one;
- device busy time (sum of kernel times on CUDA; of the ops' own CPU time on a CPU) and the gap between
  them (host-side launch/dispatch time a CUDA graph removes);
- the time by part of the step, from named code ranges set only while profiling: the experts, the
  attention kernel, the rest of the decoder pass, and the sampler (everything outside the decoder pass).
  On CUDA the parts are kernel time, each kernel placed by the GPU-side span that holds it
  (`parts_by_gpu_spans`), and add up to the busy time; on a CPU they are wall time;
- the busy time by kernel class, from kernel / op names (first match wins; a name the patterns do not
  know counts as "other", so the classes add up to the busy time): experts, attention, sampler, dense
  GEMM, norm, other;
- the top kernels (name, calls per step, ms per step);
- the experts' achieved bandwidth (their bytes per step, `roofline.step_bytes`, over their time), so a
  report can say how far they are from the memory-bandwidth floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time

import torch

CLASSES = [  # (class, pattern on the lower-cased kernel or op name); order matters
    ("experts", r"moe|grouped|groupproblemshape|experts"),
    ("attention", r"flash|fmha|attention|sdpa|attn"),
    ("sampler", r"sampler|multinomial|exponential|argmax|argsort|sort|cumsum|randint|random|distribution|philox"),
    ("dense GEMM", r"gemm|matmul|aten::mm|aten::addmm|aten::bmm|aten::linear|linear_q|scaled_mm|cutlass|xmma|cublas|"
                   r"nvjet|sm90_|sm80_"),
    ("norm", r"norm"),
]


def time_ms(fn, device: torch.device, repeats: int = 3) -> float:
    """One kernel call's time in ms: `triton.testing.do_bench` on CUDA (warm-up, L2 flush, median), the best
    of `repeats` wall-clock calls elsewhere (for the benchmark scripts' per-kernel tables)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pat in CLASSES:
        if re.search(pat, low):
            return cls
    return "other"


def _device_rows(prof, cuda: bool) -> list[tuple[str, int, float]]:
    """(name, calls, self time in us) of every kernel (CUDA) or every op with its own CPU time (CPU)."""
    rows = []
    for e in prof.key_averages():
        if e.key.startswith("bp::"):  # our code ranges (and, on CUDA, their GPU-side spans): not kernels
            continue
        if cuda:
            if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
                continue
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, int(e.count), float(us)))
    return rows


def _range_us(prof, name: str, cuda: bool) -> float:
    """Time inside the code range `name`: its kernels' device time (CUDA) or its CPU wall time (CPU)."""
    total = 0.0
    for e in prof.events():
        if e.name != name or str(getattr(e, "device_type", "CPU")).split(".")[-1] != "CPU":
            continue
        total += (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) if cuda \
            else e.cpu_time_total
    return total


def parts_by_gpu_spans(kernels: list[tuple[float, float, float]], spans: dict[str, list[tuple[float, float]]]
                       ) -> dict[str, float]:
    """Kernel time (us) by the innermost named span holding each kernel on the GPU's own timeline.

    kernels: (start, end, us) of every kernel; spans: "experts" / "attention" / "decode" -> the [start, end] of
    that code range's GPU-side span (the profiler records one per record_function on CUDA). A kernel goes to
    experts or attention if a span of theirs holds its midpoint, else to decode if a decode span does, else to
    "outside" (the sampler and the engine's own work). Unlike the CPU-side range's device time, this counts
    kernels launched without an aten op (Triton's), which torch 2.11's profiler left out of the experts' range
    on an H200 (the Triton experts showed up under "sampler")."""
    import bisect

    ordered = {n: sorted(spans.get(n, ())) for n in ("experts", "attention", "decode")}  # one name's spans: disjoint
    starts = {n: [a for a, _ in sp] for n, sp in ordered.items()}

    def inside(t: float, name: str) -> bool:  # the last span starting at or before t holds t, or none does
        i = bisect.bisect_right(starts[name], t) - 1
        return i >= 0 and t <= ordered[name][i][1]

    out = {"experts": 0.0, "attention": 0.0, "decode": 0.0, "outside": 0.0}
    for start, end, us in kernels:
        mid = (start + end) / 2
        part = next((n for n in ("experts", "attention", "decode") if inside(mid, n)), "outside")
        out[part] += us
    return out


def _gpu_spans(prof) -> tuple[list[tuple[float, float, float]], dict[str, list[tuple[float, float]]]]:
    """(kernels, spans) for parts_by_gpu_spans from a CUDA profile's device-side events."""
    kernels, spans = [], {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        start, end = e.time_range.start, e.time_range.end
        if e.name.startswith("bp::"):
            spans.setdefault(e.name[4:], []).append((start, end))
        else:
            kernels.append((start, end, float(end - start)))  # a kernel's own span on the GPU
    return kernels, spans


class _NamedPasses:
    """The passes (the module's or its fixed-shape ones), each decoder pass inside a profiler range (the engine takes passes as an argument:
    nothing of the module's is replaced)."""

    def __init__(self, passes):
        self.passes = passes

    def decode(self, *args, **kwargs):
        from torch.profiler import record_function

        with record_function("bp::decode"):
            return self.passes.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.passes, name)


@contextlib.contextmanager
def _ranges(module):
    """Name the experts, attention and decoder-pass code ranges while profiling: the attention through the module's
    `ops`, the experts through forward hooks, the decoder pass by the passes `profile_steps` hands the engine;
    all undone after, so the timed runs never carry them."""
    from torch.profiler import record_function

    def named(fn, name):
        def wrapper(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return wrapper

    ops = module.ops
    fixed = ops.fixed_attention  # the fixed-shape passes' kernel, where one is set
    module.ops = dataclasses.replace(ops, attention=named(ops.attention, "bp::attention"),
                                     fixed_attention=fixed and named(fixed, "bp::attention"))
    open_ranges = []

    def enter(mod, args):
        rf = record_function("bp::experts")
        rf.__enter__()
        open_ranges.append(rf)

    def leave(mod, args, out):
        open_ranges.pop().__exit__(None, None, None)

    hooks = [h for layer in module.layers for h in (layer.experts.register_forward_pre_hook(enter),
                                                    layer.experts.register_forward_hook(leave))]
    try:
        yield
    finally:
        module.ops = ops
        for h in hooks:
            h.remove()


def profile_steps(module, ids: torch.Tensor, cfg, canvas_length: int, sampler: str = "exact",
                  top: int = 12, passes=None) -> dict:
    """Profile the denoising steps 2..N of one canvas (fixed steps) on `ids`; see the module docstring. passes: the
    passes to run (None: the module's span passes; the fixed-shape passes CUDA graphs replay, uncaptured, to see
    the kernels a graph holds)."""
    from torch.profiler import ProfilerActivity, profile

    from ..engine import generate as engine
    from ..options import Options
    from .roofline import step_bytes

    dev = module.device
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    steps, marks = 0, []
    cfg = dataclasses.replace(cfg, max_new_tokens=canvas_length)
    torch.manual_seed(0)
    started = False
    with _ranges(module):
        events = engine.stream(module, ids, cfg, canvas_length, options=Options(sampler=sampler),
                               passes=_NamedPasses(passes if passes is not None else module))
        try:
            for ev in events:
                if isinstance(ev, engine.Draft):
                    if cuda:
                        torch.cuda.synchronize(dev)
                    marks.append(time.perf_counter())
                    if not started:  # step 1 (after the prompt's encoder pass) is left out
                        prof.start()
                        started = True
                    else:
                        steps += 1
                elif isinstance(ev, engine.Commit):
                    break
        finally:
            if started:
                prof.stop()
            events.close()
    if steps == 0:
        raise ValueError("the profile needs at least 2 denoising steps per canvas (--steps 2 or more)")
    per_step = 1e3 * steps  # us in total -> ms per step
    wall_ms = (marks[-1] - marks[0]) * 1e3 / steps
    rows = _device_rows(prof, cuda)
    busy_ms = sum(us for _, _, us in rows) / per_step
    by_class: dict[str, float] = {cls: 0.0 for cls, _ in CLASSES}
    by_class["other"] = 0.0
    for name, _, us in rows:
        by_class[kernel_class(name)] += us / per_step
    total = busy_ms if cuda else wall_ms  # what the parts add up to: kernel time (CUDA), wall time (CPU)
    kernels_gpu, spans = _gpu_spans(prof) if cuda else ([], {})
    if spans.get("decode"):  # CUDA: each kernel by the GPU-side span that holds it
        us = parts_by_gpu_spans(kernels_gpu, spans)
        experts, attention = us["experts"] / per_step, us["attention"] / per_step
        by_part = {"experts": experts, "attention": attention, "decoder, rest": us["decode"] / per_step,
                   "sampler": max(total - (us["experts"] + us["attention"] + us["decode"]) / per_step, 0.0)}
    else:  # CPU (or no GPU-side spans): the ranges' own times
        experts, attention, decode = (_range_us(prof, f"bp::{n}", cuda) / per_step
                                      for n in ("experts", "attention", "decode"))
        by_part = {"experts": experts, "attention": attention, "decoder, rest": max(decode - experts - attention, 0.0),
                   "sampler": max(total - decode, 0.0)}
    if module.ops.block is not None:  # compiled blocks: the ranges inside a block are traced away (the experts and
        # attention counted 0 ms on an H100); their kernels' names place them instead
        experts, attention = by_class["experts"], by_class["attention"]
        by_part.update({"experts": experts, "attention": attention,
                        "decoder, rest": max(by_part["decoder, rest"] - experts - attention, 0.0)})
    kernels = [{"name": name, "class": kernel_class(name), "calls_per_step": calls / steps,
                "ms_per_step": us / per_step} for name, calls, us in sorted(rows, key=lambda r: -r[2])[:top]]
    B, T = ids.shape[0], ids.shape[1]
    expert_bytes = step_bytes(module, B, canvas_length, T)["experts"]
    out = {"steps_profiled": steps, "kernels_per_step": sum(calls for _, calls, _ in rows) / steps,
           "wall_ms_per_step": wall_ms, "busy_ms_per_step": busy_ms,
           "gap_ms_per_step": max(wall_ms - busy_ms, 0.0), "timer": "CUDA kernels" if cuda else "CPU ops (self)",
           "parts_add_up_to": "busy" if cuda else "wall", "by_part_ms": by_part, "by_class_ms": by_class,
           "top": kernels, "expert_bytes_per_step": expert_bytes}
    if experts > 0:
        out["experts_achieved_gbs"] = expert_bytes / (experts / 1e3) / 1e9
    return out


def print_profile(p: dict, title: str = "") -> None:
    """Three small tables: time per step by part, by kernel class, then the top kernels."""
    lines = [f"{title} step profile ({p['timer']}, {p['steps_profiled']} steps): wall {p['wall_ms_per_step']:.2f} ms, "
             f"busy {p['busy_ms_per_step']:.2f} ms, gap {p['gap_ms_per_step']:.2f} ms per step, "
             f"{p['kernels_per_step']:.0f} {'kernels' if p['timer'] == 'CUDA kernels' else 'ops'} per step"]
    total = (p["busy_ms_per_step"] if p["parts_add_up_to"] == "busy" else p["wall_ms_per_step"]) or 1.0
    lines.append(f"  {'part of the step':<16} {'ms/step':>9} {'share':>7}   ({p['parts_add_up_to']} time)")
    for part, ms in p["by_part_ms"].items():
        lines.append(f"  {part:<16} {ms:9.3f} {ms / total:7.1%}")
    busy = p["busy_ms_per_step"] or 1.0
    floors = p.get("floor_ms_by_class")  # bench's: each class's roofline floor
    lines.append(f"  {'kernel class':<16} {'ms/step':>9} {'share':>7}" + (
        f" {'floor ms':>9} {'x floor':>8} {'above it':>9}" if floors else "") + "   (busy time)")
    for cls, ms in sorted(p["by_class_ms"].items(), key=lambda kv: -kv[1]):
        floor = None if floors is None else floors.get(cls, 0.0)
        lines.append(f"  {cls:<16} {ms:9.3f} {ms / busy:7.1%}" + ("" if floor is None else (
            f" {floor:9.3f} {ms / floor:7.1f}x {ms - floor:9.3f}" if floor > 0 else f" {'-':>9} {'-':>8} {ms:9.3f}")))
    if floors:
        floor = sum(floors.values())
        lines.append(f"  {'all':<16} {busy:9.3f} {'':>7} {floor:9.3f} {busy / floor:7.1f}x {busy - floor:9.3f}"
                     "   (norm, other: no floor counted)")
    if "experts_achieved_gbs" in p:
        lines.append(f"  experts: {p['expert_bytes_per_step'] / 1e9:.3f} GB per step at "
                     f"{p['experts_achieved_gbs']:.0f} GB/s")
    lines.append(f"  {'top kernels':<70} {'class':<11} {'calls':>6} {'ms/step':>9}")
    for k in p["top"]:
        name = k["name"] if len(k["name"]) <= 70 else k["name"][:67] + "..."
        lines.append(f"  {name:<70} {k['class']:<11} {k['calls_per_step']:6.1f} {k['ms_per_step']:9.3f}")
    print("\n".join(lines))
