"""Multi-turn GRPO on a laptop CPU: the tiny calculator model learns to call its tool.

    pip install -e . && python -m jaxrl_llm.train --config=configs/calculator_tiny.py \
        --workdir=/tmp/calculator_tiny

Three-digit products (`arithmetic/mul_3`, held-out test split for evaluation), which a
0.14M-parameter model cannot compute. The shipped model (`calculator`, made by
`configs/sft_calculator.py`) either answers at once (a guess) or writes
`<calc>482 * 917</calc>`; the turn stops at `</calc>`, the `calculator` environment
appends its value as an observation turn (`\\n441994\\n`, no loss on it), and the model
copies it as its answer. Greedy, it mostly guesses; GRPO, rewarded by the gsm8k check of
the final answer, makes the call its habit. Watch `env/tool_calls` and `eval/pass@1`.

Hardware: 2 CPU cores; nothing is downloaded.
Expected result (measured, 2 CPU cores shared with a test run): held-out greedy
eval/pass@1 on 128 prompts 0.16 / 0.24 / 0.33 / 0.53 / 0.71 / 0.78 / 0.81 at steps
0 / 10 / ... / 60, eval/tool_calls 0.25 -> 0.98; the whole command takes 25 s on quiet
cores with the compilation cache warm (~1.5 minutes cold on busy ones). The curve is in
the README.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "calculator"  # jaxrl_llm/assets/calculator_model
    c.data.name = "arithmetic/mul_3"
    c.data.template = "{question}="
    c.data.chat_template = "never"  # observations in the plain format
    c.data.max_prompt_len = 24
    c.data.pad_multiple = 8
    c.rollout.batch_size = 16  # prompts per step
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 12  # one turn: the call (11 tokens) or the answer + EOS
    c.env.name = "calculator"
    c.env.options = {"verifier": "gsm8k", "answer_key": "answer"}
    c.env.stop_tokens = ("</calc>",)  # a call ends the turn
    c.env.max_turns = 2  # call, then answer
    c.env.max_total_tokens = 40
    c.env.workers = 1
    c.rewards = {}  # the environment scores the final answer
    c.algo.name = "grpo"
    c.algo.beta = 0.0
    c.optim.learning_rate = 1e-4
    c.train.num_steps = 60
    c.train.log_every = 5
    c.train.print_samples_every = 20
    c.train.verifier_workers = 1
    c.eval.every = 10
    c.eval.split = "test"
    c.eval.num_prompts = 128
    c.eval.pass_k = 1
    c.checkpoint.every = 0
    return c
