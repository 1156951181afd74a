"""The one place that turns `Options` into the kernels a model runs (and its storage).

`apply(module, old, new)` is called by `BlockDiffusionLM` at load and by `configure`: it quantises the weights where
the storage asks for it (one way: a quantised model stays quantised), picks the kernels for the device
(`configure` in kernels/__init__.py), sets the Triton kernels' tiles and wraps the blocks in torch.compile. It
returns whether what the passes run changed (CUDA graphs captured before must be captured again).
"""

from __future__ import annotations

from ..errors import InputError
from ..options import Options


def apply(module, old: Options | None, new: Options) -> bool:
    """Make `module` run as `new` says (it ran as `old`; None: a module just built or loaded). Returns whether its
    kernels changed."""
    from . import configure
    from .linear_q import set_linear_tiles
    from .moe_grouped import set_moe_sum, set_moe_tiles

    changed = new.changed(old) if old is not None else set(new.__dataclass_fields__)
    try:
        if changed & {"moe_tiles", "moe_sum", "linear_tiles"}:
            set_moe_tiles(new.moe_tiles)
            set_moe_sum(new.moe_sum)
            set_linear_tiles(new.linear_tiles)
        if changed & {"experts", "attention", "sc_topk", "precision", "group_size", "linears", "compile"}:
            configure(module, experts=new.experts, attention=new.attention, precision=new.precision,
                      group_size=new.group_size, sc_topk=new.sc_topk, linears=new.linears,
                      compile_blocks=new.compile)
    except ValueError as e:
        raise InputError(str(e)) from None
    return bool(changed & {"experts", "attention", "sc_topk", "precision", "group_size", "linears", "compile",
                           "moe_tiles", "moe_sum", "linear_tiles"})
