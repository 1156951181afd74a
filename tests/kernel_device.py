"""Where the Triton agreement tests put their tensors.

Without CUDA the kernels run in Triton's interpreter, on CPU tensors. With CUDA (and TRITON_INTERPRET unset) they
are compiled, and a compiled kernel given CPU tensors fails: the tests must hand it CUDA tensors. `DEV` is the one
device that works; `COMPILED` says which case it is, for the few assertions that differ (a compiled fp32 `/` is
`div.full.f32`, within 2 ulp of IEEE division, not equal to it)."""

import pytest
import torch

from blockpress.kernels._triton import triton, usable_on

DEV = torch.device("cuda" if torch.cuda.is_available() and usable_on(torch.device("cuda")) else "cpu")
COMPILED = DEV.type == "cuda"
needs_triton = pytest.mark.skipif(triton is None or not usable_on(DEV),
                                  reason="triton not installed (pip install triton), or TRITON_INTERPRET=0 "
                                         "without CUDA")
