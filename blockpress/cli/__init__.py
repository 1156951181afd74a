"""`blockpress <command>`: one dispatcher, one module per command.

Each command module exposes `add_parser(subparsers)` (registers its flags) and `main(args) -> int`.
Only the module of the command being run is imported (`blockpress --help` imports none, and no
torch: it answers at once), and a missing optional extra (server, train) only affects its own command,
which names the extra to install. A `BlockpressError` is
printed as one line (no traceback) and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import signal
import sys

COMMANDS = {
    "run": "generate from a prompt, showing the canvas as it denoises",
    "infill": "fill [MASK:n] holes in a text, seeing the text on both sides",
    "chat": "multi-turn chat that keeps the KV cache between turns",
    "serve": "OpenAI-compatible HTTP server with a live web page",
    "bench": "speed benchmark (tokens/s, ms per step, roofline fraction)",
    "train": "train or fine-tune (full or LoRA) with the DiffusionGemma objective",
    "eval": "evaluate a model on a task (e.g. sudoku)",
    "convert": "convert or quantize a checkpoint",
    "tune": "time the GPU kernels' settings on this card and keep the fastest",
}


# optional packages -> the extra (pyproject.toml) that installs them
EXTRAS = {"fastapi": "server", "uvicorn": "server", "pydantic": "server", "starlette": "server",
          "matplotlib": "train", "peft": "train", "triton": "gpu"}
ALL = object()  # build_parser(ALL): every command's flags


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, as every other error of the CLI is: the problem and where the
    flags are listed (argparse prints the whole usage block first, a screenful for `run`)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(command: str | None | object = ALL) -> argparse.ArgumentParser:
    """The parser with every command listed; the flags of `command` only (ALL: of every command)."""
    parser = Parser(
        prog="blockpress",
        description="Fast, local engine for block-diffusion language models (DiffusionGemma).",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"blockpress {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            continue  # command not built yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command is ALL or command == name:
            mod = importlib.import_module(f"{__name__}.{name}")
            mod.add_parser(p)
            p.set_defaults(_module=mod)
    return parser


def _lenient_stdout() -> None:
    """A stdout that cannot encode every character (PYTHONIOENCODING=ascii, a latin-1 terminal) writes what it cannot
    as "?", as stderr writes escapes: a reply, or the stats line's "·", ended the command in a UnicodeEncodeError
    traceback after the generation."""
    import codecs

    out = sys.stdout
    if isinstance(out, io.TextIOWrapper) and out.errors == "strict" and codecs.lookup(out.encoding).name != "utf-8":
        try:
            out.reconfigure(errors="replace")
        except (ValueError, OSError):
            pass


def _lenient_stdin() -> None:
    """Invalid UTF-8 on stdin reaches the commands as surrogate escapes, which their text checks name in one line
    (`tokenizer.check_text`), as Python reads stdin under a C locale; where the locale makes it strict
    (en_US.UTF-8) `run -`, `infill -` and every turn of `chat` ended in a UnicodeDecodeError traceback."""
    stdin = sys.stdin
    if isinstance(stdin, io.TextIOWrapper) and stdin.errors == "strict":
        try:
            stdin.reconfigure(errors="surrogateescape")
        except (ValueError, OSError):  # a closed or detached stream: nothing will be read from it
            pass


class Terminated(SystemExit):
    """SIGTERM, raised where the command runs (`_unwind_on_sigterm`): it exits 143 as a killed process does."""


def _unwind_on_sigterm():
    """SIGTERM (`timeout`, systemd, a batch scheduler, `kill`) ends a command as SystemExit(143) rather than at once,
    so that what an interrupted write cleans up on the way out is cleaned up: a save's temp folder beside its output
    (model/weights.py `write_atomic`: a partial copy of the whole checkpoint), a live canvas's terminal state.
    Returns the handler it replaced (None where none was replaced)."""

    def terminated(signum, frame):
        raise Terminated(128 + signum)

    try:
        return signal.signal(signal.SIGTERM, terminated)
    except ValueError:  # not the main thread (main() called from a thread): the default action stays
        return None


def main(argv: list[str] | None = None) -> int:
    from ..errors import BlockpressError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    args._argv = argv  # the command line as given (a training run's resume hint repeats it)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    _lenient_stdin()
    _lenient_stdout()
    previous = _unwind_on_sigterm() if args.command != "serve" else None  # (the server drains: uvicorn's handler)
    try:
        return int(args._module.main(args) or 0)
    except BlockpressError as e:
        print(f"blockpress {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"blockpress {args.command}: error: this command needs the '{extra}' extra ({e.name} is not "
              f"installed); pip install 'blockpress[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # python -m blockpress.cli
    sys.exit(main())
