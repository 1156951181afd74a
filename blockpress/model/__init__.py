"""The DiffusionGemma model as plain nn.Modules. Importing it can import Triton (through torch's compiler), so
Triton's mode is decided first (`blockpress._triton_env`)."""

from .. import _triton_env  # noqa: F401
