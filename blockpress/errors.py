"""User-facing errors.

Every error a user can provoke (bad files, bad configs, bad sampling values, oversized prompts)
is a `BlockpressError` subclass whose message is one line that names the problem and the fix.
The CLI prints the message without a traceback; the server maps it to a 4xx response.
"""


class BlockpressError(Exception):
    """Base class: the message is meant for the user as is."""


class ConfigError(BlockpressError, ValueError):
    """config.json / generation_config.json is missing a field or holds an invalid value."""


class CheckpointError(BlockpressError):
    """Weights are missing, truncated, of the wrong shape, or in a format we refuse to read."""


class SamplingError(BlockpressError, ValueError):
    """A sampling parameter is outside its valid range."""


class UnknownParameterError(SamplingError, TypeError):
    """A sampling keyword the call does not take (a typo, or another library's name for a parameter)."""


class InputError(BlockpressError, ValueError):
    """A prompt or request that the model cannot take (too long, empty, wrong shape)."""
