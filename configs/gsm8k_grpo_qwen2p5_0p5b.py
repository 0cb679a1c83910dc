"""GRPO on GSM8K with Qwen2.5-0.5B-Instruct, one GPU.

    python -m jaxrl_llm.train --config=configs/gsm8k_grpo_qwen2p5_0p5b.py \
        --workdir=/tmp/gsm8k_grpo [--config.model.path=/path/to/Qwen2.5-0.5B-Instruct]

Hardware: one 80 GB GPU (H100 / A100), bf16 parameters. The model is fetched from the
hub on first use unless model.path is a local directory; GSM8K must be prepared for TFDS
once (`tfds build gsm8k`, or data.download=True on a machine with internet).
Expected: eval/pass@1 on the test split rises over the first few hundred steps (the
base model answers roughly a third to a half of GSM8K); not yet measured on this exact
configuration, so compare your curve against the first eval point of your own run.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "Qwen/Qwen2.5-0.5B-Instruct"
    c.model.dtype = "bfloat16"
    c.data.name = "gsm8k"
    c.data.split = "train"
    c.data.max_prompt_len = 256
    c.rollout.batch_size = 32  # prompts per step
    c.rollout.num_generations = 8  # G
    c.rollout.max_new_tokens = 512
    c.rollout.temperature = 1.0
    c.algo.name = "grpo"  # beta 0.04 (k3), clip 0.2, seq-mean-token-mean
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.micro_batches = 4  # 256 rows x 768 tokens per step, 64 rows per micro-batch
    c.rewards = {"gsm8k": 1.0}
    c.train.num_steps = 500
    c.train.log_every = 1
    c.train.print_samples_every = 25
    c.eval.every = 50
    c.eval.split = "test"
    c.eval.num_prompts = 256
    c.eval.pass_k = 8
    c.checkpoint.every = 50
    return c
