"""User-facing errors: the CLI turns each into one line on stderr and exit status 2."""


class KareusError(Exception):
    """Base of every error caused by what the user asked for (not a bug)."""


class SpecError(KareusError, ValueError):
    """A job, model, GPU or knob that is invalid or unknown."""
