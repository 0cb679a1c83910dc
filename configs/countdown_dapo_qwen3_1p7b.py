"""DAPO on the synthetic countdown task with Qwen3-1.7B, one GPU.

    python -m jaxrl_llm.train --config=configs/countdown_dapo_qwen3_1p7b.py \
        --workdir=/tmp/countdown_dapo

Hardware: one 80 GB GPU (H100), bf16; remat on the layers to fit 16 x 1024-token rollouts
per prompt. The countdown data (4 numbers, target reachable by construction) is generated
locally by the package's TFDS builder: no download. DAPO: clip-higher 0.2/0.28,
token-mean loss, no KL, dynamic sampling (groups with all-equal rewards are replaced),
overlong penalty. Expected: the format reward saturates first, then eval/pass@1 on the
held-out split climbs; not yet measured on this exact configuration.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "Qwen/Qwen3-1.7B"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.data.name = "countdown/numbers_4"
    c.data.max_prompt_len = 256
    c.rollout.batch_size = 16
    c.rollout.num_generations = 16
    c.rollout.max_new_tokens = 1024
    c.algo.name = "dapo"
    c.optim.learning_rate = 1e-6
    c.optim.micro_batches = 8
    c.rewards = {
        "countdown": 1.0,
        "format": {
            "weight": 0.1,
            "options": {"pattern": r"(?s).*<think>.*</think>\s*<answer>.*</answer>\s*"},
        },
    }
    c.eval.correct_reward = "countdown"
    c.train.num_steps = 400
    c.eval.every = 40
    c.eval.split = "test"
    c.checkpoint.every = 40
    return c
