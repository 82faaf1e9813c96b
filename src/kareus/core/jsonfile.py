"""Reading a JSON object from a file, with one clear error for every way it can fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kareus.errors import SpecError

MAX_DEPTH = 64
"""The deepest nesting of a document Kareus reads. Its own files nest less than ten levels
(a plan: plan, execution, instruction, setting), a Perseus profile three, a Hugging Face
config two or three. Python's parser overflows its stack a little under a thousand levels
(a RecursionError, issue 34), and code walking a document recursively may sooner."""


def loads(text: str, source: str) -> Any:
    """The JSON document in ``text``; SpecError naming ``source`` if it nests deeper than
    `MAX_DEPTH` levels. Malformed JSON raises json.JSONDecodeError, for the caller's
    message."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise SpecError(too_deep(source)) from None
    check_depth(doc, source)
    return doc


def check_depth(doc: Any, source: str) -> None:
    """SpecError if ``doc`` (parsed JSON or YAML: dicts, lists, scalars) nests deeper than
    `MAX_DEPTH`; iterative, so any depth is measured without recursion."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            raise SpecError(too_deep(source))
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list, tuple)))


def too_deep(source: str) -> str:
    return f"{source}: nested deeper than {MAX_DEPTH} levels (Kareus's limit)"


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in ``path``; SpecError naming ``what`` if missing, unreadable, not
    JSON, nested deeper than `MAX_DEPTH`, or not an object."""
    p = Path(path)
    try:
        doc = loads(p.read_text(), f"{what} {p}")
    except FileNotFoundError:
        raise SpecError(f"{what} not found: {p}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read {what} {p}: {exc}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{what} {p} is not a JSON object")
    return doc
