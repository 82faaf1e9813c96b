"""The name checks every Kareus directory and output file gets before any work (issue 34,
items 6 and 8): a name the run could not write, or not print, is one error up front."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.core.atomic import TAG_MAX, temp_dir
from kareus.core.names import check_name, shown
from kareus.errors import KareusError


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 300), char=st.sampled_from(["a", "é", "字"]))
def test_a_name_is_accepted_exactly_when_its_temporary_name_can_be_made(tmp_path_factory,
                                                                      length, char):
    parent = tmp_path_factory.mktemp("names")
    path = parent / (char * length)
    beside = temp_dir(path, "x" * TAG_MAX)
    try:
        check_name(path, "--out", beside.name)
    except KareusError as exc:
        assert "too long" in str(exc)
        with pytest.raises(OSError):  # and it could not be made
            beside.mkdir()
    else:
        beside.mkdir()  # what the run makes beside it, with the longest tag
        path.mkdir()


def test_a_whole_path_too_long_is_refused(tmp_path):
    deep = tmp_path.joinpath(*["d" * 200] * 25)  # over 4096 bytes, each part short
    with pytest.raises(KareusError, match="path is too long"):
        check_name(deep, "--out", "x")


def test_a_name_that_is_not_utf8_is_refused_and_shown(tmp_path):
    name = os.fsdecode(b"r\xff")
    with pytest.raises(KareusError, match="not a valid UTF-8") as exc:
        check_name(tmp_path / name, "--out", name)
    str(exc.value).encode("utf-8")  # the message itself prints
    assert shown(name) == "r\\xff"
