"""blockpress: a fast, local engine for block-diffusion language models (DiffusionGemma).

Public API:
    load(model, device=None, dtype=None) -> BlockDiffusionLM   (folder or Hub id)
    from_config(config, ...)            -> BlockDiffusionLM   (random weights)
    BlockDiffusionLM.generate / stream / generate_text / save
    GenerationConfig, GenerationResult, Draft, Commit, Finished, BlockpressError

The names are imported on first use (PEP 562), so `import blockpress.cli` (and `blockpress --help`)
does not pay for importing torch; `import blockpress; blockpress.load(...)` works as before.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import BlockpressError, CheckpointError, ConfigError, InputError, SamplingError, UnknownParameterError

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "load": ".loading", "from_config": ".loading", "BlockDiffusionLM": ".lm",
    "GenerationConfig": ".config", "ModelConfig": ".config", "TextConfig": ".config",
    "GenerationResult": ".engine.generate", "Draft": ".engine.generate", "Commit": ".engine.generate",
    "Finished": ".engine.generate",
}

__all__ = [
    "load", "from_config", "BlockDiffusionLM", "GenerationConfig", "ModelConfig", "TextConfig",
    "GenerationResult", "Draft", "Commit", "Finished", "BlockpressError", "CheckpointError", "ConfigError",
    "InputError", "SamplingError", "UnknownParameterError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'blockpress' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
