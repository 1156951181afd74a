"""Triton's mode, decided once before anything can import Triton.

On a machine without CUDA, Triton can only run in its interpreter, so `TRITON_INTERPRET=1` is set (unless the user
already chose). It has to happen before Triton is first imported, which is earlier than blockpress's kernels:
torch imports Triton itself the first time `torch.compiler` / dynamo is touched (the model does, at import). So
`blockpress.model` and `blockpress.kernels._triton` both import this module first. With CUDA nothing changes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
