import sys

import pytest

from kareus.errors import KareusError
from kareus.gpu.kernels import import_torch


def test_without_torch_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails
    with pytest.raises(KareusError) as info:
        import_torch()
    msg = str(info.value)
    assert "\n" not in msg
    assert "pip install -e '.[gpu]'" in msg  # how this project installs, from a clone
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in msg
    assert "'kareus[gpu]'" not in msg  # not on a package index


def test_with_torch_it_is_torch():
    torch = pytest.importorskip("torch")
    assert import_torch() is torch


@pytest.mark.parametrize("missing", ["pynvml", "zeus.device"])
def test_without_zeus_or_nvml_the_error_says_how_this_project_installs(monkeypatch, missing):
    """The nvml backend's install hints (issue 21, item 6): from a clone, never from an
    index that has no kareus."""
    from kareus.gpu import device

    if missing == "zeus.device":  # NVML present and seeing a GPU: Zeus is what lacks
        monkeypatch.setattr(device, "_require_nvidia_gpu", lambda _index: None)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(KareusError) as info:
        device.ZeusDevice(0)
    msg = str(info.value)
    assert "\n" not in msg and "pip install -e '.[gpu]'" in msg, msg
    assert "'kareus[gpu]'" not in msg
