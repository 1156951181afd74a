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


TASKS = ("sudoku",)  # the tasks a model folder may name


def task_info(lm: Any) -> dict[str, Any]:
    """What a model folder says it was trained for: its `blockpress_task.json` (e.g.
    `{"task": "sudoku", "format": "inplace"}`), else the `blockpress_task` / `task` field of its config,
    else {}. `lm` is a loaded model (anything with `.path` and `.config.raw`). A file that is not a JSON object,
    or names no task of `TASKS`, is an InputError naming the file and the fix (it was ignored, and a Sudoku model
    was then read as a text model)."""
    path = getattr(lm, "path", None)
    info = None
    if path is not None:
        f = Path(path) / "blockpress_task.json"
        if f.is_file():
            try:
                info = json.loads(f.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                raise InputError(f"{f} is not valid JSON ({type(e).__name__}: {str(e).splitlines()[0]}); fix it, "
                                 'e.g. {"task": "sudoku", "format": "prompt"}, or delete it') from None
            if not isinstance(info, dict):
                raise InputError(f'{f} must be a JSON object, e.g. {{"task": "sudoku", "format": "prompt"}}; '
                                 "fix it or delete it")
            where = str(f)
    if info is None:  # config.json: its "blockpress_task" names one of ours; a "task" of another tool's is no task
        raw = getattr(getattr(lm, "config", None), "raw", None) or {}
        task = raw.get("blockpress_task") or (raw.get("task") if raw.get("task") in TASKS else None)
        info, where = ({"task": task} if task else {}), "config.json's blockpress_task"
    if "task" in info and info["task"] not in TASKS:
        raise InputError(f"{where} names the task {info['task']!r}, which blockpress does not know (it knows "
                         f"{', '.join(TASKS)}); fix it, or delete it for a text model")
    return info
