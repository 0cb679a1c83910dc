"""GRPO on MATH with Llama-3.1-8B-Instruct on a TPU v5p-64 pod slice (multi-host).

    # on every host of the slice (see launch/tpu_pod.sh, which does this for you):
    python -m jaxrl_llm.train --config=configs/math_grpo_llama3_8b_tpu.py \
        --workdir=gs://BUCKET/runs/math_grpo_llama3_8b \
        --config.data.path=/data/math_train.jsonl --config.eval.path=/data/math_test.jsonl

Hardware: TPU v5p-64 (32 chips, 95 GB HBM each), 8 hosts. Mesh: FSDP over all 32 chips
(bf16 parameters, float32 master copy and Adam moments sharded 32 ways: 3.3 GiB per
chip), full remat of every layer, 8 micro-batches of 64 rollouts (2 rows of 512 + 1,536
tokens per chip).
Data: MATH as a local JSONL ({"problem", "solution"} rows) on every host; rewards: LaTeX
answer equivalence (math-verify). Expected: eval/pass@1 on held-out MATH rises over the
first hundred steps; not yet measured (no pod was available when this was written).

Target topology `v5p:2x4x4` (the slice above). Compiled for it by XLA:TPU (docs/tpu.md),
the update fits: 27.32 GiB per chip at its peak (3.28 GiB arguments, 24.04 GiB
temporaries) of the chip's 95 GiB; the reference 5.51 GiB, the sampler 6.34 GiB (0.47 +
5.87, its KV cache included). Predicted step (roofline):
13.9 s, 10.4 of them the sampler's decoding (every weight read once per token). The
step compiled for those chips on any CPU machine with libtpu, nothing run:

    python -m jaxrl_llm.train --config=configs/math_grpo_llama3_8b_tpu.py --compile_for=v5p:2x4x4

It fits a v6e-32 (`--compile_for=v6e:4x8`) as it is: the update 21.99 GiB per chip of 32,
predicted step 19.3 s.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "meta-llama/Llama-3.1-8B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.data.source = "jsonl"
    c.data.path = "/data/math_train.jsonl"
    c.data.fields = {"question": "problem", "answer": "solution"}
    c.data.template = "{question}\nReason step by step and put the final answer in \\boxed{{}}."
    c.data.max_prompt_len = 512
    c.rollout.batch_size = 64
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 1536
    c.algo.name = "grpo"
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.micro_batches = 8
    c.rewards = {"math": 1.0}
    c.train.num_steps = 300
    c.train.logprob_chunk = 256
    c.eval.every = 25
    c.eval.path = "/data/math_test.jsonl"
    c.checkpoint.every = 25
    c.checkpoint.keep = 2
    return c
