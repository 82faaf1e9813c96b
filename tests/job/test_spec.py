import json

import pytest

from kareus.errors import SpecError
from kareus.job.presets import JOB_PRESETS
from kareus.job.sources import build_job, load_hf_config


@pytest.mark.parametrize("name", list(JOB_PRESETS))
def test_every_job_preset_validates(name):
    job = build_job(name)
    assert job.tp * job.cp * job.pp * job.dp == job.num_gpus


def test_paper_presets_follow_facts_order():
    expected = [
        ("llama3.2-3b", 8, 1, 8, 4096), ("llama3.2-3b", 4, 2, 8, 4096),
        ("llama3.2-3b", 4, 2, 8, 8192), ("llama3.2-3b", 4, 2, 16, 4096),
        ("qwen3-1.7b", 8, 1, 8, 4096), ("qwen3-1.7b", 8, 1, 8, 8192),
        ("qwen3-1.7b", 8, 1, 16, 4096), ("qwen3-1.7b", 4, 2, 8, 4096),
        ("qwen3-1.7b", 4, 2, 8, 8192), ("qwen3-1.7b", 4, 2, 16, 4096),
    ]
    for i, (model, tp, cp, mbs, seq) in enumerate(expected, start=1):
        job = build_job(f"kareus-{i}")
        assert (job.model.name, job.tp, job.cp, job.micro_batch_size, job.seq_length) == (
            model, tp, cp, mbs, seq)
        assert job.pp == 2 and job.layers_per_stage == (15, 13)
        assert job.num_microbatches == 8 and job.nodes == 2 and job.gpus_per_node == 8
        assert job.gpu == "A100-40GB" and job.recompute and not job.sequence_parallel


def test_dp_is_derived_and_layers_split_evenly():
    job = build_job(overrides=dict(model="llama3.1-8b", tp=2, pp=3, nodes=3))
    assert job.dp == 4
    assert job.layers_per_stage == (11, 11, 10)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tp=5), "tp=5 must divide the 24 attention heads"),
        (dict(tp=2, cp=3, seq=4097), "cp=3 must divide the sequence length"),
        (dict(mbs=0), "micro_batch_size: Input should be greater than or equal to 1"),
        (dict(layers_per_stage=(15, 12)), "sums to 27"),
        (dict(layers_per_stage=(28,)), "has 1 entries but pp=2"),
        (dict(dp=2), "must equal the 16 GPUs"),
        (dict(gpu="V100"), "unknown GPU 'V100'"),
        (dict(search_freqs_mhz=(1410, 1405)), "1405 MHz is not a supported clock"),
        (dict(sm_choices_all_reduce=(0, 3)), "outside 1..107"),
        (dict(tp=4, cp=4), "must fit in one node"),
    ],
)
def test_invalid_jobs_name_the_problem(overrides, message):
    renamed = {"mbs": "micro_batch_size", "seq": "seq_length"}
    overrides = {renamed.get(k, k): v for k, v in overrides.items()}
    with pytest.raises(SpecError, match=message):
        build_job("kareus-1", overrides=overrides)


def test_kv_heads_replicated_or_rejected():
    # 8 KV heads: TP 16 would replicate them, but TP must also fit a node; use a 2-KV model
    job = build_job(overrides=dict(
        model=dict(name="tiny", hidden_size=1024, num_layers=4, num_attention_heads=8,
                   num_kv_heads=2, ffn_hidden_size=4096, vocab_size=1000),
        tp=4))
    assert job.kv_heads_replicated and job.local_kv_heads == 1
    assert "KV heads replicated x2" in job.describe()
    with pytest.raises(SpecError, match="KV heads"):
        build_job(overrides=dict(
            model=dict(name="odd", hidden_size=1152, num_layers=4, num_attention_heads=12,
                       num_kv_heads=6, ffn_hidden_size=4096, vocab_size=1000),
            tp=4))


def test_hugging_face_config_import(tmp_path):
    cfg = {
        "model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 6144, "vocab_size": 151936,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_hf_config(tmp_path)
    assert model.qk_norm and model.head_dim == 128 and model.num_layers == 28
    job = build_job("kareus-5", overrides={"model": str(tmp_path / "config.json")})
    assert job.model.hidden_size == 2048


def test_hf_config_without_head_dim_derives_it(tmp_path):
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert load_hf_config(p).head_dim == 128


def test_broken_hf_configs_are_spec_errors(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(SpecError, match="cannot read"):
        load_hf_config(p)
    p.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SpecError, match="lacks"):
        load_hf_config(p)
    with pytest.raises(SpecError, match="not found"):
        load_hf_config(tmp_path / "missing.json")


def test_job_file_then_flags_override(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("preset: kareus-1\nnum_microbatches: 16\nlayers_per_stage: [14, 14]\n")
    job = build_job(config=f)
    assert job.num_microbatches == 16 and job.layers_per_stage == (14, 14)
    job = build_job(config=f, overrides={"num_microbatches": 4})
    assert job.num_microbatches == 4


def test_bad_job_files(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="mapping"):
        build_job(config=f)
    f.write_text("model: llama3.2-3b\nbogus_field: 1\n")
    with pytest.raises(SpecError, match="bogus_field"):
        build_job(config=f)
    f.write_text("model: [unclosed\n")
    with pytest.raises(SpecError, match="cannot parse"):
        build_job(config=f)


def test_job_files_report_every_unknown_key_and_yaml_positions(tmp_path):
    from kareus.errors import SpecError
    from kareus.job.sources import build_job

    typos = tmp_path / "typos.yaml"
    typos.write_text("preset: kareus-1\ntpp: 4\nmicrobatchs: 3\n")
    with pytest.raises(SpecError, match="unknown fields: tpp, microbatchs"):
        build_job(config=str(typos))
    broken = tmp_path / "broken.yaml"
    broken.write_text("preset: kareus-1\ntp: [4\n")
    with pytest.raises(SpecError, match=r"line 3, column 1: expected ','"):
        build_job(config=str(broken))


@pytest.mark.parametrize("mbs, splits", [(1, False), (2, True), (3, False), (8, True)])
def test_any_positive_micro_batch_size_is_a_job(mbs, splits):
    """Issue 23: Megatron-LM and Perseus run at the job's own micro-batch size; only the
    methods that split a microbatch into two nanobatches need an even one."""
    job = build_job("kareus-1", overrides={"micro_batch_size": mbs})
    assert job.micro_batch_size == mbs and job.splits_into_nanobatches is splits
    assert f"this job has {mbs}" in job.nanobatch_requirement
    if splits:
        assert job.nanobatch_size == mbs // 2
    else:
        with pytest.raises(SpecError, match=r"no nanobatches.*even micro-batch size >= 2"):
            _ = job.nanobatch_size
