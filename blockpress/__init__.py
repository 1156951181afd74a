"""blockpress: a fast, local engine for block-diffusion language models (DiffusionGemma).

Public API:
    load(model, device=None, dtype=None) -> BlockDiffusionLM   (folder or Hub id)
    from_config(config, ...)            -> BlockDiffusionLM   (random weights)
    BlockDiffusionLM.generate / stream / generate_text / save
    GenerationConfig, GenerationResult, Draft, Commit, Finished, BlockpressError
"""

from .config import GenerationConfig, ModelConfig, TextConfig
from .engine.generate import Commit, Draft, Finished, GenerationResult
from .errors import BlockpressError, CheckpointError, ConfigError, InputError, SamplingError
from .lm import BlockDiffusionLM
from .loading import from_config, load

__version__ = "0.1.0"

__all__ = [
    "load", "from_config", "BlockDiffusionLM", "GenerationConfig", "ModelConfig", "TextConfig",
    "GenerationResult", "Draft", "Commit", "Finished", "BlockpressError", "CheckpointError", "ConfigError",
    "InputError", "SamplingError",
]
