"""Optional Triton import, done once for every kernel module.

Job: give the kernel modules `triton` / `tl` (or None) without making Triton a dependency.
Invariant: on a machine without CUDA, Triton runs in its interpreter (`TRITON_INTERPRET=1`, set by
`blockpress._triton_env` before Triton is first imported): the mode our CPU agreement tests use.
"""

from __future__ import annotations

import os

import torch

from .. import _triton_env  # noqa: F401  (before `import triton`)

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a broken install (missing driver libraries)
    triton = None
    tl = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable_on(device: torch.device) -> bool:
    """Can a Triton kernel run on tensors of `device`? (CUDA compiled, or CPU through the interpreter.)"""
    if triton is None:
        return False
    if device.type == "cuda":
        return not interpreted()
    return device.type == "cpu" and interpreted()


def fp8_usable_on(device: torch.device) -> bool:
    """Can a Triton kernel take float8_e4m3fn there? Not before sm_89: Triton refuses to compile e4m3 for Ampere
    (`benchmarks/compile_report.py --arch 86` shows it), so fp8 weights take the torch paths on those cards."""
    if not usable_on(device):
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
