"""GRPO on MATH with Qwen3-1.7B and 16k-token responses on a TPU v5p-32 slice (multi-host).

    # on every host of the slice (launch/tpu_pod.sh does this for you):
    python -m jaxrl_llm.train --config=configs/math_grpo_qwen3_1p7b_16k_tpu.py \
        --workdir=gs://BUCKET/runs/math_grpo_qwen3_1p7b_16k \
        --config.data.path=/data/math_train.jsonl --config.eval.path=/data/math_test.jsonl

Hardware: TPU v5p-32 (16 chips, 95 GB HBM each), 4 hosts. Long reasoning: up to 1,024
prompt + 16,384 response tokens per row. What makes the length fit
(docs/long_context.md): attention whose memory is linear in the length
(`model.attention='auto'`: the Pallas splash kernel on TPU; blockwise on CPU), full remat
of every layer, log-probs in chunks of 256 positions, and one row per chip in each
micro-batch (256 rows in 16 micro-batches of 16, FSDP over the 16 chips).
Memory budget, from XLA's analysis of the compiled update (benchmarks/attention_memory.py
--model=qwen3-1.7b --prompt=1024 --lengths=16384 --paths=blockwise: CPU, one unsharded
device, one row of 1,024 + 16,384 tokens per micro-batch, the portable blockwise
attention): 32.6 GiB of temporaries, of which 26.8 GiB are there at 1,024 + 1,024 tokens
too (parameter-sized: the float32 gradient and the optimizer's update, which FSDP splits
16 ways) and 5.8 GiB grow with the row's tokens (a chip's share: one row). Parameters
and fp32 Adam state (~27 GB for 1.7B) are split 16 ways as well; the sampler's KV cache holds
at most 256 rows x 17,408 slots x 28 layers x 8 kv heads x 128 x 2 (k, v) in bf16 =
511 GB, 32 GB a chip (the decode loop grows it in segments: the full length only at the
end). Expected: eval/pass@1 on held-out MATH rises over the first hundred steps, and
the mean response length grows; not yet measured (no slice was available when this
was written).

Compiled for v5p:2x2x4 by XLA:TPU (docs/tpu.md), the update fits: 39.55 GiB per chip at
its peak (1.41 GiB arguments, 38.14 GiB temporaries) of the chip's 95 GiB; the
reference 5.97 GiB, the sampler 35.54 GiB. Predicted step (roofline): 133 s, 121 of them
the sampler's decoding.

Target topology `v5p:2x2x4` (the slice above). Its step compiled for those chips on any CPU
machine with libtpu, nothing run (docs/tpu.md has the figures):

    python -m jaxrl_llm.train --config=configs/math_grpo_qwen3_1p7b_16k_tpu.py --compile_for=v5p:2x2x4

On 32 chips, one row per chip is `--config.optim.micro_batches=8`: as shipped (16 rows a
micro-batch) the rows do not split over 32 chips and each chip runs all 16 (a v6e-32
compile asks 413 GiB of temporaries; start-up warns). With it a v6e-32 (`v6e:4x8`) fits:
the update's peak is 30.36 of a chip's 32 GiB.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "Qwen/Qwen3-1.7B"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.model.attention = "auto"  # TPU: Pallas splash; memory linear in the length
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.data.source = "jsonl"
    c.data.path = "/data/math_train.jsonl"
    c.data.fields = {"question": "problem", "answer": "solution"}
    c.data.template = "{question}\nReason step by step and put the final answer in \\boxed{{}}."
    c.data.max_prompt_len = 1024
    c.rollout.batch_size = 32
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 16384
    c.rollout.prefill_chunk = 512  # prompts into the KV cache 512 tokens at a time
    c.algo.name = "grpo"
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.micro_batches = 16  # 16 rows of 17k tokens each: one per chip
    c.rewards = {"math": 1.0}
    c.train.num_steps = 200
    c.train.logprob_chunk = 256
    c.eval.every = 25
    c.eval.path = "/data/math_test.jsonl"
    c.checkpoint.every = 25
    c.checkpoint.keep = 2
    return c
