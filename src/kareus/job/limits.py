"""Upper bounds of every size a job is built from (`kareus.job.spec.JobSpec` checks them).

The work and memory of building a workload and simulating an iteration grow with them
(issue 34: 10^8 microbatches grew to 13.7 GB before answering), so each is refused above a
limit far beyond any real job, in one line naming the limit (`first_error_line`).
"""

MAX_LAYERS = 1024
"""The deepest public dense models have ~100-130 layers (Llama 3.1 405B: 126)."""
MAX_HIDDEN_SIZE = 1 << 17
"""131,072: public models reach hidden sizes of ~16k-25k (Llama 3.1 405B: 16,384)."""
MAX_FFN_HIDDEN_SIZE = 1 << 19
"""524,288: public FFNs reach ~53k (Llama 3.1 405B: 53,248)."""
MAX_HEADS = 1024
"""Public models have at most ~128 attention heads (Llama 3.1 405B: 128)."""
MAX_HEAD_DIM = 4096
"""Public head sizes are 64-256."""
MAX_VOCAB_SIZE = 1 << 22
"""4,194,304: the largest public vocabularies have ~256k tokens (Gemma 3: 262,144)."""
MAX_SEQ_LENGTH = 1 << 22
"""4,194,304 tokens: public long-context training reaches ~1M-token sequences."""
MAX_MICRO_BATCH_SIZE = 4096
"""Sequences per microbatch: real jobs use 1-32 (memory bound)."""
MAX_MICROBATCHES = 16384
"""Microbatches per iteration: a 16k-GPU run with a 16M-token batch has tens per
replica (Llama 3: 16 stages, batch 2,048 x 8,192 tokens over 128 replicas)."""
MAX_GPUS_PER_NODE = 1024
"""One NVLink domain: 8 GPUs per server, 72 in a GB200 NVL72 rack, 576 announced."""
MAX_GPUS = 1 << 17
"""131,072 GPUs: the largest public training runs use 16k+ GPUs (Llama 3: 16,384), the
largest reported clusters ~100k."""
MAX_PIPELINE_INSTRUCTIONS = 1 << 18
"""262,144 forward and backward instructions per iteration (virtual stages x microbatches
x 2): 16 stages x 8,192 microbatches. Simulating one iteration of this size takes ~15 s
and ~0.5 GB here; the work and memory grow linearly beyond it."""
MAX_KNOB_CHOICES = 256
"""Entries of a list of SM counts or clocks: GPUs have ~100-150 SMs and ~100 clocks."""
