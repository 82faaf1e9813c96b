"""Reading a JSON object from a file, with one clear error for every way it can fail."""

from __future__ import annotations

import json
from pathlib import Path

from kareus.errors import SpecError


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in ``path``; SpecError naming ``what`` if missing, unreadable, not
    JSON, or not an object."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"{what} not found: {p}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read {what} {p}: {exc}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{what} {p} is not a JSON object")
    return doc
