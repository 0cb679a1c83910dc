"""Multi-turn GRPO on GSM8K with a Python interpreter (ReTool-style): Qwen2.5-0.5B-Instruct
may write a ```python block, the `python_tool` environment runs it in the sandbox and
answers its output in a tool turn (Qwen's template has the tool role); the final answer
after '####' is scored by `gsm8k`.

    python -m jaxrl_llm.train --config=configs/python_tool_gsm8k_qwen2p5_0p5b.py \
        --workdir=/tmp/python_tool [--config.model.path=/path/to/Qwen2.5-0.5B-Instruct]

Hardware: one 80 GB GPU, bf16 parameters, and CPU cores for the sandboxes (env.workers).
GSM8K must be prepared for TFDS once (`tfds build gsm8k`). Run as root for the sandbox's
namespaces (no network, an unprivileged user): see docs/verifiers_and_data.md.
Expected: not yet measured on this configuration; watch `env/tool_calls`,
`env/tool_errors` and `env/python_tool/correct` next to `reward/mean`.
"""

from jaxrl_llm.config import base_config

SYSTEM = (
    "You can run Python: write a ```python code block and stop; its printed output comes "
    "back in the next message. Give the final answer after '####'."
)


def get_config():
    c = base_config()
    c.model.path = "Qwen/Qwen2.5-0.5B-Instruct"
    c.model.dtype = "bfloat16"
    c.data.name = "gsm8k"
    c.data.split = "train"
    c.data.template = "{question}"
    c.data.system_prompt = SYSTEM
    c.data.max_prompt_len = 320
    c.rollout.batch_size = 32
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 256  # one turn
    c.rollout.stop_tokens = ("<|im_end|>",)
    c.env.name = "python_tool"
    c.env.options = {"verifier": "gsm8k", "max_output_chars": 512, "wall_s": 4.0}
    c.env.max_turns = "2@0,4@100"  # one tool call at first, up to three later
    c.env.max_total_tokens = 1024
    c.env.step_timeout_s = 8.0  # above the sandbox's wall_s + interpreter start-up
    c.env.workers = 16
    c.rewards = {}
    c.algo.name = "grpo"
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.micro_batches = 8
    c.train.num_steps = 500
    c.train.print_samples_every = 25
    c.eval.every = 0  # multi-turn evaluation plays whole trajectories: costly at this size
    c.checkpoint.every = 50
    return c
