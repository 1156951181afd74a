"""Task definitions built on the engine (data generation, exact checking, evaluation), e.g. `sudoku`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import InputError


def read_data_file(path: Path) -> str:
    """The text of a data file (training data, evaluation passages), or an InputError that names the problem."""
    if path.is_dir():
        raise InputError(f"{path} is a folder, not a data file; give 'sudoku', a chat .jsonl file, or a plain-text "
                         ".txt/.jsonl file")
    if not path.is_file():
        raise InputError(f"data file {path} not found; give 'sudoku', a chat .jsonl file, or a plain-text "
                         ".txt/.jsonl file")
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark (some editors write one) is not text
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


def task_info(lm: Any) -> dict[str, Any]:
    """What a model folder says it was trained for: its `blockpress_task.json` (e.g.
    `{"task": "sudoku", "format": "inplace"}`), else the `blockpress_task` / `task` field of its config,
    else {}. `lm` is a loaded model (anything with `.path` and `.config.raw`)."""
    path = getattr(lm, "path", None)
    if path is not None:
        f = Path(path) / "blockpress_task.json"
        if f.is_file():
            try:
                info = json.loads(f.read_text())
            except ValueError:
                return {}
            return info if isinstance(info, dict) else {}
    raw = getattr(getattr(lm, "config", None), "raw", None) or {}
    task = raw.get("blockpress_task") or raw.get("task")
    return {"task": task} if task else {}
