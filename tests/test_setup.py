"""The README's install and test commands, as CI runs them, and type checking without
the optional extras (PyTorch, Zeus, NVML)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _readme_test_command() -> str:
    (cmd,) = [c for c in re.findall(r"```bash\n(.*?)\n```", README, re.S)
              if "pytest" in c and "pip install -e '.[test]'" in c]
    return cmd


def _ci_lines() -> list[str]:
    return [ln.strip() for ln in CI.splitlines() if ln.strip() and not ln.startswith("#")]


def test_ci_runs_the_readme_test_command_first_without_torch_then_with_it():
    cmd = _readme_test_command()
    assert cmd.startswith("python3 -m venv .venv && ")
    lines = _ci_lines()
    runs = [i for i, ln in enumerate(lines) if ln == cmd]
    torch = [i for i, ln in enumerate(lines) if re.search(r"pip install .*\btorch\b", ln)]
    extras = [i for i, ln in enumerate(lines)
              if "pip install" in ln and "[gpu,ray,megatron]" in ln]
    assert len(runs) == 2, "CI runs the README's test command twice"
    assert torch and extras
    assert runs[0] < min(torch + extras), "the first run is in a venv without PyTorch"
    assert max(torch + extras) < runs[1], "the second has PyTorch, gpu, ray and megatron"


def test_the_test_extra_does_not_pull_torch():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test = project["optional-dependencies"]["test"]
    names = [re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() for d in test]
    assert "torch" not in names and "kareus" not in names, test
    assert "torch" not in [re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower()
                           for d in project["dependencies"]]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy not installed")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="without PyTorch the README's own `mypy` step checks this")
def test_mypy_passes_as_if_torch_zeus_and_nvml_were_not_installed(tmp_path):
    """What `mypy` sees on a machine without the gpu extra: torch, Zeus and NVML's binding
    are not followed (mypy makes them Any, as it does for a missing module)."""
    tomllib = pytest.importorskip("tomllib")
    from mypy import api

    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    lines = ["[mypy]"]
    for key, value in settings.items():
        if key == "overrides":
            continue
        if isinstance(value, list):
            value = ",".join(str(ROOT / v) if key == "files" else str(v) for v in value)
        lines.append(f"{key} = {value}")
    lines += ["[mypy-torch.*,zeus.*,pynvml.*]", "follow_imports = skip",
              "follow_imports_for_stubs = True"]
    config = tmp_path / "mypy.ini"
    config.write_text("\n".join(lines) + "\n")
    out, err, code = api.run(["--config-file", str(config), "--cache-dir",
                              str(tmp_path / "cache"), "--python-executable", sys.executable])
    assert code == 0, out + err
