"""GRPO on GSM8K with Llama-3.1-8B-Instruct and LoRA adapters, on one 80 GB GPU.

    python -m jaxrl_llm.train --config=configs/gsm8k_grpo_lora_llama3_8b.py \
        --workdir=/tmp/gsm8k_grpo_lora_8b [--config.model.path=/path/to/Llama-3.1-8B-Instruct]
    python -m jaxrl_llm.export --workdir=/tmp/gsm8k_grpo_lora_8b --out=/tmp/adapter --lora=peft

Hardware: one 80 GB GPU (H100 / A100), bf16 weights. Only rank-16 adapters on every
attention and MLP projection train (42M parameters): their float32 master copy and Adam
moments take ~0.5 GB, where a full fine-tune's would take 96 GB (8B x 12 bytes) and not
fit. The 16 GB of bf16 base weights are loaded once and shared by the policy, the
reference (beta = 0.04: the base with the adapters off) and the sampler. The sampler
applies the adapters unmerged: a merged weight set would be a second, transient 14 GB
copy of the projections, and on a GPU a decode step reads the 16 GB of weights anyway,
to which the adapters add under 1%. KV cache: 128 rows x 768 tokens x 128 KB = 12 GB.
The update runs 16 micro-batches of 8 rows with every layer rematerialized.
The model is fetched from the hub on first use (a gated repository: `huggingface-cli
login`) unless model.path is a local directory; GSM8K must be prepared for TFDS once
(`tfds build gsm8k`, or data.download=True on a machine with internet).
Expected: eval/pass@1 on the test split rises from the instruct model's starting point
over the first hundred steps; not yet measured on this configuration, so compare against
the step-0 evaluation of your own run.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "meta-llama/Llama-3.1-8B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"  # activations of one layer at a time in the backward
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0  # alpha / rank = 2, the common LoRA-for-RL setting
    c.model.lora.sampler = "unmerged"  # no transient merged copy (see the docstring)
    c.data.name = "gsm8k"
    c.data.split = "train"
    c.data.max_prompt_len = 256
    c.rollout.batch_size = 16  # prompts per step
    c.rollout.num_generations = 8  # G
    c.rollout.max_new_tokens = 512
    c.algo.name = "grpo"  # beta 0.04 (k3) against the base, clip 0.2
    # Adapters start at B = 0 and move in a low-dimensional space: LoRA recipes use a
    # learning rate ~10x a full fine-tune's.
    c.optim.learning_rate = 1e-5
    c.optim.warmup_steps = 10
    c.optim.micro_batches = 16  # 128 rows x 768 tokens per step, 8 rows per micro-batch
    c.rewards = {"gsm8k": 1.0}
    c.train.num_steps = 300
    c.train.logprob_chunk = 128  # [8 rows, 128 positions, 128k vocab] float32 = 0.5 GB
    c.train.print_samples_every = 25
    c.eval.every = 50
    c.eval.split = "test"
    c.eval.num_prompts = 256
    c.eval.pass_k = 8
    c.checkpoint.every = 50  # adapters only: ~0.6 GB per checkpoint with the moments
    return c
