"""Where a JobSpec comes from: presets, a YAML job file, a Hugging Face config.json, flags.

Precedence, lowest first: preset < job file < command-line flags. The model may be a preset
name, a path to a Hugging Face ``config.json`` (or a directory holding one), or a mapping
with the ModelSpec fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kareus.core.jsonfile import check_depth, read_json_object, too_deep
from kareus.errors import SpecError
from kareus.job.hardware import get_gpu
from kareus.job.model import ModelSpec
from kareus.job.presets import JOB_PRESETS, MODEL_PRESETS, preset_names
from kareus.job.spec import JobSpec, validate_job
from kareus.job.validation import first_error_line

_HF_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""How the Hugging Face families name their routed experts: Mixtral (num_local_experts),
Qwen-MoE and OLMoE (num_experts), DeepSeek (n_routed_experts), DBRX and ERNIE
(moe_num_experts; DBRX's inside ffn_config)."""


def _refuse_moe(raw: dict[str, Any], source: str) -> None:
    """Kareus models dense FFNs only: a config with more than one expert would be planned
    as a dense model, wrong by its whole expert part, so it is refused (issue 34)."""
    nested = [v for v in raw.values() if isinstance(v, dict)]  # DBRX: ffn_config
    for where in (raw, *nested):
        for key in MOE_KEYS:
            n = where.get(key)
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 1:
                raise SpecError(f"{source}: a mixture-of-experts model ({key} = {n:g}); "
                                f"Kareus models dense transformers only")


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read the transformer shape from a Hugging Face ``config.json`` (file or directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    raw = read_json_object(p, "model config")
    _refuse_moe(raw, str(p))
    missing = [k for k in _HF_REQUIRED if k not in raw]
    if missing:
        raise SpecError(f"{p} lacks {', '.join(missing)}: not a decoder-only transformer config")
    model_type = str(raw.get("model_type", ""))
    name = raw.get("_name_or_path") or p.parent.name or model_type or "hf-model"
    data = dict(
        name=str(name),
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim"),
        ffn_hidden_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        # Qwen3 normalises queries and keys per head; its configs do not carry a flag for it.
        qk_norm=bool(raw.get("qk_norm", model_type.startswith("qwen3"))),
    )
    return _model_from_dict(data, source=str(p))


def _model_from_dict(data: dict[str, Any], source: str) -> ModelSpec:
    from pydantic import ValidationError

    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"invalid model ({source}): {first_error_line(exc)}") from None


def resolve_model(value: Any) -> ModelSpec:
    """A model from a preset name, a config.json path, a mapping, or a ModelSpec."""
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, dict):
        if "num_hidden_layers" in value:  # an inline Hugging Face config
            _refuse_moe(value, "inline config")
            tmp = {k: v for k, v in value.items()}
            return _model_from_dict(
                dict(
                    name=str(tmp.get("name", tmp.get("model_type", "hf-model"))),
                    hidden_size=tmp.get("hidden_size"),
                    num_layers=tmp.get("num_hidden_layers"),
                    num_attention_heads=tmp.get("num_attention_heads"),
                    num_kv_heads=tmp.get("num_key_value_heads", tmp.get("num_attention_heads")),
                    head_dim=tmp.get("head_dim"),
                    ffn_hidden_size=tmp.get("intermediate_size"),
                    vocab_size=tmp.get("vocab_size"),
                    qk_norm=bool(tmp.get("qk_norm", False)),
                ),
                source="inline config",
            )
        return _model_from_dict(value, source="inline model")
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"model must be a name or a path, got {value!r}")
    key = value.strip().lower()
    if key in MODEL_PRESETS:
        return ModelSpec.model_validate(MODEL_PRESETS[key])
    path = Path(value).expanduser()
    if path.suffix == ".json" or path.is_dir() or path.exists():
        return load_hf_config(path)
    raise SpecError(
        f"unknown model {value!r}; known: {', '.join(MODEL_PRESETS)} "
        f"(or a path to a Hugging Face config.json)"
    )


def load_job_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) job file into a mapping of JobSpec fields."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise SpecError(f"cannot parse job file {too_deep(str(p))}") from None
    except FileNotFoundError:
        raise SpecError(f"job file not found: {p}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError(f"cannot parse job file {p}: {where}"
                        f"{exc.problem or exc.context or 'invalid YAML'}") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(f"cannot parse job file {p}: {first}") from None
    if data is None:
        return {}
    check_depth(data, f"job file {p}")
    if not isinstance(data, dict):
        raise SpecError(f"job file {p} must hold a mapping of job fields")
    if "preset" in data:
        data = {**preset_fields(str(data.pop("preset"))), **data}
    model = data.get("model")
    if isinstance(model, str) and model.lower() not in MODEL_PRESETS:
        # Relative config.json paths in a job file are relative to the file.
        candidate = (p.parent / model).expanduser()
        if candidate.exists():
            data["model"] = str(candidate)
    return data


def preset_fields(name: str) -> dict[str, Any]:
    key = name.strip().lower()
    if key in JOB_PRESETS:
        return dict(JOB_PRESETS[key])
    if key in MODEL_PRESETS:
        return {"model": key}
    raise SpecError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")


def build_job(
    preset: str | None = None,
    config: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> JobSpec:
    """Merge preset < job file < overrides (None values ignored) into a validated JobSpec."""
    data: dict[str, Any] = {}
    if preset is not None:
        data.update(preset_fields(preset))
    if config is not None:
        data.update(load_job_file(config))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if ("gpu" in given and "node" not in given and "gpu" in data
            and get_gpu(str(given["gpu"])).name != get_gpu(str(data["gpu"])).name):
        # another GPU than the preset's or file's: their node type holds theirs, so the
        # job takes the new GPU's default node unless one is named with it
        data.pop("node", None)
    data.update(given)
    if "model" not in data:
        raise SpecError("no model given: pass --preset NAME, --model NAME|config.json or --config")
    data["model"] = resolve_model(data["model"])
    return validate_job(data)
