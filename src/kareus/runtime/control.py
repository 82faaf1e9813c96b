"""What the operator asks of a running training (issue 39): a control document or a
programmatic request names exactly one of a deadline, a power cap or a plan id; the
control file is read so that each request is applied once.

Reading and checking requests is apart from choosing plans (`kareus.runtime.plan_switcher`):
an integration reads the file on one rank and shares the document; every rank's switcher
answers it. No framework is imported here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kareus.errors import KareusError

CONTROL_KEYS = ("deadline_s", "power_cap_kw", "plan")
"""What a control file (or a programmatic request) may ask for: exactly one of them."""


def check_request(doc: Mapping[str, Any], where: str) -> tuple[str, float | str]:
    """The one (key, value) of a control document or request; KareusError (one line,
    prefixed with ``where``) unless it is exactly one of CONTROL_KEYS with a positive
    finite number (a non-empty plan id for "plan")."""
    if not isinstance(doc, Mapping):
        raise KareusError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    keys = sorted(doc)
    if len(keys) != 1 or keys[0] not in CONTROL_KEYS:
        raise KareusError(f"{where}: give exactly one of {', '.join(CONTROL_KEYS)}; got "
                          f"{', '.join(map(str, keys)) or 'nothing'}")
    key = keys[0]
    value = doc[key]
    if key == "plan":
        if not isinstance(value, str) or not value.strip():
            raise KareusError(f"{where}: \"plan\" must be a plan id such as \"kareus-042\"")
        return key, value
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise KareusError(f"{where}: {key} must be a positive number, got {value!r}")
    return key, float(value)


class ControlFile:
    """The operator's control file at ``path``: `read` returns each new request once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, str] | None = None

    def read(self) -> dict[str, Any] | None:
        """The request in the file, or None where there is no file or it is unchanged
        since the last read (by mtime, size and content hash). A malformed file raises
        KareusError (one line) once: the same file is not reported again until it
        changes."""
        try:
            st = self.path.stat()
            data = self.path.read_bytes()
        except FileNotFoundError:
            self._seen = None  # written again later, even identical: a new request
            return None
        except OSError as exc:
            raise KareusError(f"control file {self.path}: {exc.strerror or exc}") from None
        key = (st.st_mtime_ns, st.st_size, hashlib.sha256(data).hexdigest())
        if key == self._seen:
            return None
        self._seen = key
        try:
            doc = json.loads(data.decode("utf-8"))
        except RecursionError:
            raise KareusError(f"control file {self.path}: nested too deeply to be a "
                              f"request") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise KareusError(f"control file {self.path}: not JSON "
                              f"({str(exc).splitlines()[0] if str(exc) else 'empty'})"
                              ) from None
        if not isinstance(doc, dict):
            raise KareusError(f"control file {self.path}: expected a JSON object such as "
                              f"{{\"deadline_s\": 4.2}}")
        check_request(doc, f"control file {self.path}")
        return doc


_CONTROL_FILES: dict[str, ControlFile] = {}


def read_control_file(path: str | Path) -> dict[str, Any] | None:
    """The operator's request in ``path`` (one JSON object: {"deadline_s": x} or
    {"power_cap_kw": x} or {"plan": "kareus-042"}, exactly one key), or None where the file
    does not exist or is unchanged since it was last read here (keyed by mtime, size and
    content hash: each request is applied once). A malformed file raises KareusError with
    one line (the integration logs it and keeps the running plan)."""
    reader = _CONTROL_FILES.setdefault(os.path.abspath(path), ControlFile(path))
    return reader.read()


__all__ = ["CONTROL_KEYS", "ControlFile", "check_request", "read_control_file"]
