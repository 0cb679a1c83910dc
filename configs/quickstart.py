"""Quickstart: GRPO on held-out two-digit arithmetic, from the tiny model shipped in the
package, on a laptop CPU in a few minutes. Nothing is downloaded.

    pip install -e . && python -m jaxrl_llm.train --config=configs/quickstart.py \
        --workdir=/tmp/quickstart

Hardware: 2 CPU cores are enough (the model has 0.14M parameters).
The model (`jaxrl_llm/assets/quickstart_model`, made by `configs/sft_arithmetic.py`) was
fine-tuned on answers half of which repeat themselves ("6565" for 65), a habit the
gsm8k-style check scores 0; its arithmetic is better than its reward. GRPO with that
check as the reward removes the habit.
Expected result (measured, 2 CPU cores, ~1 minute): held-out greedy eval/pass@1 rises
from 0.28 (the shipped model) to ~0.49 by step 50 and 0.48-0.53 after; the curve is in
the README.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "quickstart"  # jaxrl_llm/assets/quickstart_model
    c.data.name = "arithmetic/digits_2"  # generated locally from a seed: no download
    c.data.template = "{question}="  # the SFT format: "What is 48 * 17?=" -> "816"
    c.data.chat_template = "never"
    c.data.max_prompt_len = 20
    c.data.pad_multiple = 8
    # Speed settings (micro-batches, log-prob chunk, unrolled layers, prompt buckets) are
    # left to the trainer, which picks them for the machine at start-up (jaxrl_llm.tuning).
    c.rollout.batch_size = 32  # prompts per step
    c.rollout.num_generations = 8  # G
    c.rollout.max_new_tokens = 10
    c.algo.name = "grpo"
    c.algo.beta = 0.0  # no reference model: a tiny model, a short run
    c.optim.learning_rate = 1e-4  # 3e-4 makes held-out accuracy wander instead of rise
    c.rewards = {"gsm8k": 1.0}  # the number the completion ends with must equal the answer
    c.train.num_steps = 300
    c.train.log_every = 5
    c.train.print_samples_every = 50
    c.train.verifier_workers = 1
    c.eval.every = 50
    c.eval.split = "test"
    c.eval.num_prompts = 256
    c.eval.pass_k = 8
    c.checkpoint.every = 100
    return c
