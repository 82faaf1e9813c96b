"""The training settings that change the kernels (kareus.job.training)."""

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.errors import SpecError
from kareus.job.nanobatch import default_split
from kareus.job.presets import ARTIFACT_TRAINING, JOB_PRESETS
from kareus.job.sources import build_job
from kareus.job.spec import validate_job
from kareus.job.training import TrainingSettings
from kareus.store import job_id

PLAIN = dict(model="llama3.2-3b", tp=2, pp=2, num_microbatches=4, nodes=1)


def _job(**fields):
    return build_job(None, overrides={**PLAIN, **fields})


def _refusal(**fields) -> str:
    with pytest.raises(SpecError) as e:
        _job(**fields)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_defaults_are_what_kareus_assumed():
    t = _job().training
    assert (t.hidden_dropout, t.attention_dropout) == (0.0, 0.0)
    assert t.gradient_accumulation_fusion and t.apply_rope_fusion and t.bias_activation_fusion
    assert not t.cross_entropy_loss_fusion and t.cross_entropy_fusion_impl == "native"
    assert not t.non_default() and t.describe() == ""


@pytest.mark.parametrize("fields, words", [
    (dict(training=dict(hidden_dropout=1.0)), "training.hidden_dropout"),
    (dict(training=dict(attention_dropout=-0.1)), "training.attention_dropout"),
    (dict(training=dict(hidden_dropout=float("nan"))),
     "training.hidden_dropout: not a number (nan)"),
    (dict(training=dict(cross_entropy_fusion_impl="triton")), "cross_entropy_fusion_impl"),
    (dict(training=dict(bias_dropout_add_fusion=True, bias_dropout_fusion=False,
                        hidden_dropout=0.1)), "one setting"),
    (dict(training=dict(dropout=0.1)), "unknown field: training.dropout"),
    (dict(hidden_dropout=0.1), "hidden_dropout belongs in the job's training: section"),
])
def test_bad_settings_are_refused_in_one_line(fields, words):
    assert words in _refusal(**fields)


def test_an_empty_training_section_is_the_defaults(tmp_path):
    # YAML reads "training:" with nothing under it as null
    path = tmp_path / "job.yaml"
    path.write_text("model: llama3.2-3b\ntp: 2\npp: 2\nnum_microbatches: 4\nnodes: 1\n"
                    "training:\n")
    job = build_job(None, config=path)
    assert job.training == TrainingSettings()
    assert job_id(job) == job_id(_job())


def test_nan_dropout_in_a_job_file_is_one_clear_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: llama3.2-3b\ntp: 2\npp: 2\nnum_microbatches: 4\nnodes: 1\n"
                    "training:\n  hidden_dropout: .nan\n")
    with pytest.raises(SpecError) as e:
        build_job(None, config=path)
    assert "not a number (nan)" in str(e.value) and "less than 1" not in str(e.value)
    assert "\n" not in str(e.value)


def test_aliases_and_normalisation():
    t = _job(training=dict(bias_dropout_add_fusion=False, hidden_dropout=0.1,
                           bias_swiglu_fusion=False)).training
    assert not t.bias_dropout_fusion and not t.bias_activation_fusion
    # settings that change no kernel take one value (one job, one id)
    assert _job(training=dict(bias_dropout_fusion=False)).training.bias_dropout_fusion
    assert _job(training=dict(cross_entropy_fusion_impl="te")).training == TrainingSettings()
    assert job_id(_job(training=dict(cross_entropy_fusion_impl="te"))) == job_id(_job())


_settings = st.fixed_dictionaries({}, optional={
    "hidden_dropout": st.sampled_from([0.0, 0.1, 0.5]),
    "attention_dropout": st.sampled_from([0.0, 0.1]),
    "bias_dropout_fusion": st.booleans(),
    "gradient_accumulation_fusion": st.booleans(),
    "apply_rope_fusion": st.booleans(),
    "bias_activation_fusion": st.booleans(),
    "cross_entropy_loss_fusion": st.booleans(),
    "cross_entropy_fusion_impl": st.sampled_from(["native", "te"]),
})


@settings(max_examples=60, deadline=None)
@given(preset=st.sampled_from(sorted(JOB_PRESETS)), training=_settings)
def test_ids_keep_old_jobs_and_tell_settings_apart(preset, training):
    plain = build_job(preset, overrides={"training": {}})
    # the id the code before the settings gave a job: its dump without them, by its rules
    doc = plain.model_dump(mode="json")
    del doc["training"]
    for field, default in (("virtual_pipeline", 1), ("cp_comm_type", "allgather"),
                           ("nanobatch_split", default_split(plain)), ("node", None)):
        if doc[field] == default:
            del doc[field]
    old = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    assert job_id(plain) == old
    job = build_job(preset, overrides={"training": training})
    # a round trip keeps the id; settings at their defaults are the plain job
    assert job_id(validate_job(job.model_dump(mode="json"))) == job_id(job)
    assert (job_id(job) == job_id(plain)) == (job.training == TrainingSettings())


def test_paper_presets_carry_the_artifacts_training_settings():
    # tests/artifact/conf/megatron_llama3.2_3b_config.yaml (docs/anchors.md §4)
    for i in range(1, 11):
        t = build_job(f"kareus-{i}").training
        assert t.hidden_dropout == 0.1 and t.attention_dropout == 0.0
        assert t.bias_dropout_fusion and not t.gradient_accumulation_fusion
        assert t.apply_rope_fusion and t.bias_activation_fusion
        assert t.cross_entropy_loss_fusion and t.cross_entropy_fusion_impl == "te"
    assert TrainingSettings.model_validate(ARTIFACT_TRAINING).non_default()
    # the H100 presets follow NVIDIA's recipes, whose settings are not stated: defaults
    assert build_job("llama3.1-8b-h100-mbs1").training == TrainingSettings()
