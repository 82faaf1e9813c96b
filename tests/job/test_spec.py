import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.core.jsonfile import MAX_DEPTH, check_depth, read_json_object
from kareus.errors import SpecError
from kareus.job.limits import MAX_MICROBATCHES
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


@pytest.mark.parametrize("mbs, split, size", [(1, "sequence", 1), (2, "batch", 1),
                                              (3, None, 0), (8, "batch", 4)])
def test_any_positive_micro_batch_size_is_a_job(mbs, split, size):
    """Issue 23: Megatron-LM and Perseus run at the job's own micro-batch size; only the
    methods that split a microbatch into two nanobatches need an even one, or 1 (issue 37:
    split along the sequence)."""
    job = build_job("kareus-1", overrides={"micro_batch_size": mbs})
    assert job.micro_batch_size == mbs and job.nanobatch_split == split
    assert job.splits_into_nanobatches is (split is not None)
    assert f"this job has {mbs}" in job.nanobatch_requirement
    if split:
        assert job.nanobatch_size == size
    else:
        with pytest.raises(SpecError, match=r"no nanobatches.*even micro-batch size"):
            _ = job.nanobatch_size


# Issue 34: bounds on every size, refusals of configs Kareus would model wrongly, and
# documents nested too deep, each one SpecError line.

LLAMA_405B = dict(name="llama3.1-405b-like", hidden_size=16384, num_layers=126,
                  num_attention_heads=128, num_kv_heads=8, ffn_hidden_size=53248,
                  vocab_size=128256)


def test_the_largest_public_run_is_within_every_bound():
    """Llama 3 405B's shape on 16,384 GPUs (TP8, PP16, 8k tokens, 16 microbatches)."""
    job = build_job(overrides=dict(model=LLAMA_405B, tp=8, pp=16, seq_length=8192,
                                   micro_batch_size=1, num_microbatches=16, nodes=2048,
                                   gpus_per_node=8, gpu="H100-SXM"))
    assert job.num_gpus == 16384 and job.dp == 128


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_microbatches": 100_000_000}, "num_microbatches: 100000000 is over Kareus's limit "
                                        "of 16,384"),
    ({"seq_length": 2**40}, "seq_length: 1099511627776 is over Kareus's limit of 4,194,304"),
    ({"micro_batch_size": 10**6}, "micro_batch_size: 1000000 is over Kareus's limit"),
    ({"nodes": 10**9}, "nodes: 1000000000 is over Kareus's limit of 131,072"),
    ({"nodes": 100_000}, "100000 nodes x 8 GPUs = 800,000 GPUs is over Kareus's limit of "
                         "131,072"),
    ({"gpus_per_node": 4096}, "gpus_per_node: 4096 is over Kareus's limit of 1,024"),
    ({"tp": 10**12}, "tp: 1000000000000 is over Kareus's limit"),
    ({"pp": 10**6}, "pp: 1000000 is over Kareus's limit of 1,024"),
    ({"virtual_pipeline": 10**6}, "virtual_pipeline: 1000000 is over Kareus's limit"),
    ({"dp": 10**7}, "dp: 10000000 is over Kareus's limit"),
    ({"sm_choices_all_reduce": [3] * 1000}, "sm_choices_all_reduce: more than Kareus's "
                                            "limit of 256 entries"),
    ({"search_freqs_mhz": [1410] * 10**5}, "search_freqs_mhz: more than Kareus's limit"),
    ({"model": {**LLAMA_405B, "num_layers": 10**6}}, "num_layers: 1000000 is over Kareus's "
                                                     "limit of 1,024"),
    ({"model": {**LLAMA_405B, "hidden_size": 10**30}}, "hidden_size"),
    ({"model": {**LLAMA_405B, "vocab_size": 10**9}}, "vocab_size: 1000000000 is over"),
])
def test_sizes_over_their_limit_are_one_line_naming_it(overrides, message):
    with pytest.raises(SpecError) as info:
        build_job("kareus-1", overrides=overrides)
    text = str(info.value)
    assert message in text and "\n" not in text and len(text) < 200


def test_pipeline_instructions_are_bounded():
    """Stages x microbatches x 2, what simulating an iteration grows with: at the limit a
    job, over it one line."""
    at_limit = {"num_microbatches": 16384, "virtual_pipeline": 4,
                "layers_per_stage": [4, 4, 4, 4, 3, 3, 3, 3]}
    assert build_job("kareus-1", overrides=at_limit).virtual_stages == 8
    with pytest.raises(SpecError, match="16 stages x 16384 microbatches x 2 = 524,288 "
                                        "pipeline instructions is over Kareus's limit of "
                                        "262,144"):
        build_job("kareus-1", overrides={"num_microbatches": 16384, "virtual_pipeline": 8})


@given(st.integers(min_value=-(10**30), max_value=10**30))
@settings(max_examples=60, deadline=None)
def test_any_microbatch_count_is_a_job_or_one_line(n):
    try:
        job = build_job("kareus-1", overrides={"num_microbatches": n})
    except SpecError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 200
        assert n < 1 or n > MAX_MICROBATCHES
        if n > MAX_MICROBATCHES:
            assert f"limit of {MAX_MICROBATCHES:,}" in str(exc)
    else:
        assert 1 <= job.num_microbatches <= MAX_MICROBATCHES


def test_hidden_size_must_split_into_the_heads(tmp_path):
    cfg = {"hidden_size": 1000, "num_hidden_layers": 4, "num_attention_heads": 3,
           "intermediate_size": 4096, "vocab_size": 32000}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match="hidden_size 1000 is not divisible by the 3 "
                                        "attention heads; give head_dim"):
        load_hf_config(p)
    p.write_text(json.dumps({**cfg, "head_dim": 256}))  # an explicit head size is taken
    assert load_hf_config(p).head_dim == 256


DENSE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}


@pytest.mark.parametrize("moe", [
    {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
    {"model_type": "qwen2_moe", "num_experts": 60},
    {"model_type": "deepseek_v3", "n_routed_experts": 256},
    {"model_type": "dbrx", "ffn_config": {"moe_num_experts": 16}},
], ids=["mixtral", "qwen-moe", "deepseek", "dbrx"])
def test_mixture_of_experts_configs_are_refused(tmp_path, moe):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**DENSE, **moe}))
    with pytest.raises(SpecError, match=r"a mixture-of-experts model .* Kareus models dense "
                                        r"transformers only"):
        load_hf_config(p)
    with pytest.raises(SpecError, match="mixture-of-experts"):  # inline, in a job
        build_job("kareus-1", overrides={"model": {**DENSE, **moe}})


def test_one_expert_is_a_dense_model(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**DENSE, "num_local_experts": 1, "num_experts": 0}))
    assert load_hf_config(p).num_layers == 32


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000, 200_000])
def test_configs_nested_too_deep_are_one_line(tmp_path, depth):
    p = tmp_path / "config.json"
    p.write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(SpecError, match=f"nested deeper than {MAX_DEPTH} levels"):
        load_hf_config(p)
    job = tmp_path / "job.yaml"
    job.write_text("model: llama3.2-3b\nx: " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(SpecError, match=f"nested deeper than {MAX_DEPTH} levels"):
        build_job(config=job)


def test_nesting_up_to_the_limit_is_read(tmp_path):
    p = tmp_path / "doc.json"
    p.write_text('{"a": ' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}")
    assert isinstance(read_json_object(p, "doc")["a"], list)
    p.write_text('{"a": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}")
    with pytest.raises(SpecError, match=f"doc {p}: nested deeper than {MAX_DEPTH} levels"):
        read_json_object(p, "doc")
    check_depth(_nested(MAX_DEPTH), "doc")  # parsed YAML too: dicts, lists
    with pytest.raises(SpecError, match="nested deeper"):
        check_depth({"x": _nested(MAX_DEPTH)}, "doc")


def _nested(depth: int) -> list:
    doc: list = []
    for _ in range(depth - 1):
        doc = [doc]
    return doc


def test_a_copy_with_fields_updated_is_named_anew():
    """`JobSpec.id` is cached from the fields; pydantic's model_copy copies the cache with
    them and validates nothing, so an updated copy must not keep its original's name."""
    from kareus.job.identity import job_identity

    job = build_job(preset="kareus-1")
    copy = job.model_copy(update={"num_microbatches": job.num_microbatches + 4})
    assert copy.id == job_identity(copy) != job.id
    assert job.model_copy().id == job.id
