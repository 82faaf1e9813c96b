"""One readable line from a pydantic ValidationError (how a refused job or model is told)."""

from __future__ import annotations

from pydantic import ValidationError


def first_error_line(exc: ValidationError) -> str:
    """One readable line from a pydantic ValidationError: every unknown field at once (a
    job file with several typos is fixed in one go), else the first problem found."""
    errors = exc.errors(include_url=False)
    unknown = [".".join(str(p) for p in e.get("loc", ())) for e in errors
               if e.get("type") == "extra_forbidden"]
    if unknown:
        return f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}"
    err = errors[0]
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
    ctx = err.get("ctx") or {}
    if err.get("type") == "less_than_equal":  # a size over its MAX_*: name the limit
        le = ctx.get("le")
        msg = f"{err.get('input')} is over Kareus's limit of {le:,}" if isinstance(
            le, int) else f"{err.get('input')} is over Kareus's limit of {le}"
    elif err.get("type") == "too_long":
        msg = f"more than Kareus's limit of {ctx.get('max_length')} entries"
    return f"{loc}: {msg}" if loc else msg
