"""The operator's control file and requests (kareus.runtime.control)."""

import os

import pytest

from kareus.errors import KareusError
from kareus.runtime.control import read_control_file


def test_a_control_request_is_read_once_and_again_when_it_changes(tmp_path):
    f = tmp_path / "control.json"
    assert read_control_file(f) is None  # no file
    f.write_text('{"deadline_s": 1.3}')
    assert read_control_file(f) == {"deadline_s": 1.3}
    assert read_control_file(f) is None  # applied once
    f.write_text('{"plan": "p4"}')
    assert read_control_file(f) == {"plan": "p4"}
    st_ = f.stat()
    os.utime(f, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # written again, same text
    assert read_control_file(f) == {"plan": "p4"}
    f.unlink()
    assert read_control_file(f) is None


@pytest.mark.parametrize("text", [
    "", "not json", "[1]", "{}", '{"deadline_s": 1, "plan": "p1"}', '{"deadline_s": -1}',
    '{"deadline_s": 0}', '{"deadline_s": "4"}', '{"deadline_s": true}',
    '{"power_cap_kw": NaN}', '{"plan": ""}', '{"plan": 3}', '{"speed": 3}', "\xff\xfe",
    '{"deadline_s": 1.0\n',
])
def test_a_malformed_control_file_is_one_line_once(tmp_path, text):
    f = tmp_path / "control.json"
    f.write_bytes(text.encode("latin-1"))
    with pytest.raises(KareusError) as exc:
        read_control_file(f)
    assert "\n" not in str(exc.value) and str(f) in str(exc.value)
    assert read_control_file(f) is None  # reported once, not at every iteration
    f.write_text('{"power_cap_kw": 7.5}')  # mended
    assert read_control_file(f) == {"power_cap_kw": 7.5}


def test_a_control_file_nested_too_deeply_is_one_line(tmp_path):
    """json's recursion limit is an error like any other malformed file (rank 0 must
    not die while the others wait in the broadcast)."""
    path = tmp_path / "control.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(KareusError, match="nested too deeply") as info:
        read_control_file(path)
    assert "\n" not in str(info.value)
