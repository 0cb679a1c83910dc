r"""SFT of the calculator model (`jaxrl_llm/assets/calculator_model`): the quickstart's
0.14M-parameter shape, trained from scratch on three-digit products (`arithmetic/mul_3`)
written two ways, so that RL has a tool habit to grow.

    python -m jaxrl_llm.sft --config=configs/sft_calculator.py --workdir=/tmp/sft_calculator
    cp /tmp/sft_calculator/hf/* jaxrl_llm/assets/calculator_model/   # to update the asset

Hardware: CPU (2 cores); nothing is downloaded (the data is generated locally, the
tokenizer ships in `jaxrl_llm/assets/calculator_tokenizer`).

The two ways (one per row, drawn from the data seed):
- 40%: a calculator call, the tool's answer, then the answer copied from it:
  `<calc>482 * 917</calc>` `\n441994\n` `441994` (the middle line is what the calculator
  environment appends as its observation turn, in the plain format of docs/envs.md);
- 60%: the answer at once, `441994`, which a model this small cannot compute.
The model learns to copy a number it has just read, and to start with a call on fewer
than half of its draws, so its greedy answer is mostly a guess: held-out greedy pass@1 is
low while sampled groups hold calls that score. `configs/calculator_tiny.py` is the RL
run on it.

Expected result (measured): 3000 steps in about 6 minutes on 2 CPU cores shared with a
test run, loss/nll ~0.7 at the end (most of it the direct answers' digits, which stay a
guess). From the shipped model, multi-turn greedy evaluation on 128 held-out prompts:
eval/pass@1 0.16, eval/tool_calls 0.25 (a call on a quarter of the prompts).
"""

from jaxrl_llm import assets
from jaxrl_llm.sft.config import default_config


def get_config():
    c = default_config()
    c.model.path = ""  # a new random model shaped by sft.new_model
    c.model.tokenizer = assets.CALCULATOR_TOKENIZER  # characters + <calc> </calc>

    m = c.sft.new_model
    m.architecture = "LlamaForCausalLM"
    m.hidden_size = 64
    m.intermediate_size = 256
    m.num_layers = 2
    m.num_heads = 4
    m.num_kv_heads = 4
    m.head_dim = 16
    m.max_position_embeddings = 256
    m.tie_word_embeddings = False
    m.initializer_range = 0.1

    c.data.name = "arithmetic/mul_3"
    c.data.split = "train"
    c.data.template = "{question}="  # "What is 482 * 917?="
    c.data.max_prompt_len = 24  # "<bos>What is 999 * 999?=" is 21 tokens
    c.data.pad_multiple = 8

    c.sft.batch_size = 64
    c.sft.completion.template = "{answer}"  # the direct answer
    c.sft.completion.alt_template = "<calc>{expression}</calc>\n{answer}\n{answer}"
    c.sft.completion.alt_prob = 0.4  # rows that call the calculator
    c.sft.completion.max_len = 28  # the call (11) + the observation (8) + 6 digits + EOS

    c.optim.learning_rate = 1e-2
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 50
    c.optim.end_lr_ratio = 0.0
    c.optim.weight_decay = 0.01

    c.train.num_steps = 3000
    c.train.seed = 0
    c.train.log_every = 100
    c.eval.every = 0  # the held-out evaluation that matters is multi-turn (the RL config)
    c.rollout.max_new_tokens = 28
    return c
