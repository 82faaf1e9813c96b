"""The run lock (kareus.core.lock): who holds it, asked without creating anything."""

import os

from kareus.core.lock import Lock, held_by


def test_held_by_names_the_holder_and_creates_nothing(tmp_path):
    path = tmp_path / "j.sqlite.lock"
    assert held_by(path) is None
    assert not path.exists()  # asking made no lock file
    with Lock.take(path, "journal j"):
        assert held_by(path) == f"pid {os.getpid()}"
    assert held_by(path) is None  # released: the file stays, nobody holds it
    with Lock.take(path, "journal j"):  # asking did not keep it either
        pass
