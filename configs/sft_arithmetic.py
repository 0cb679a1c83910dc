r"""SFT of the quickstart model: a tiny Llama-style decoder, trained from scratch on
`arithmetic/digits_2` (+, -, * on two-digit numbers), deliberately stopped early.

    python -m jaxrl_llm.sft --config=configs/sft_arithmetic.py --workdir=/tmp/sft_arithmetic

Hardware: CPU (a laptop, or 2 shared cores); no download (the data is generated locally,
the tokenizer ships in `jaxrl_llm/assets/arithmetic_tokenizer`).

Expected result: on 2 shared CPU cores, 8000 steps in ~11 minutes; on the 1000 held-out
prompts greedy pass@1 0.28 and pass@8 (temperature 1) 0.61, completions ~5 tokens.

The exported model (`<workdir>/hf`) is what ships as `jaxrl_llm/assets/quickstart_model`.
It is only partly trained on purpose: the RL quickstart needs prompts on which some but not
all sampled answers are right, so that GRPO groups have mixed rewards to learn from.
"""

import ml_collections

from jaxrl_llm import assets, data


def get_config():
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # "" = a new random model with the shape below
    c.model.architecture = "LlamaForCausalLM"
    c.model.hidden_size = 64
    c.model.intermediate_size = 256
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 4
    c.model.head_dim = 16
    c.model.max_position_embeddings = 256  # room for the RL trainer's prompt buckets
    c.model.tie_word_embeddings = False
    c.model.rope_theta = 10000.0
    c.model.initializer_range = 0.1  # ~1/sqrt(hidden): 0.02 (sized for d=768) learns far slower
    c.model.dtype = "float32"
    c.model.remat = "none"
    c.tokenizer = assets.ARITHMETIC_TOKENIZER  # one token per character

    c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})

    c.data = data.default_config()
    c.data.name = "arithmetic/digits_2"
    c.data.split = "train"
    c.data.template = "{question}="  # "What is 48 * 17?=" -> completion "816" + EOS
    c.data.max_prompt_len = 20  # "<bos>What is 99 * 99?=" is 18 tokens
    c.data.pad_multiple = 8

    c.completion = ml_collections.ConfigDict()
    c.completion.template = "{answer}"  # the bare number: gsm8k's last-number rule scores it
    c.completion.max_len = 10  # "98019801" + EOS is 9 tokens
    # The flaw RL is meant to fix: half of the training answers come from a teacher that
    # does not stop and repeats its answer ("6565"), which the gsm8k check scores 0. The
    # model imitates it (greedy decoding stops or repeats, per prompt), so its arithmetic
    # is better than its reward, and sampled groups hold both behaviours.
    c.completion.alt_template = "{answer}{answer}"
    c.completion.alt_prob = 0.5

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-2  # tiny models want a large step; 2e-3 barely moves in 1k steps
    c.optim.warmup_steps = 50
    c.optim.end_lr_ratio = 0.0
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 8000
    c.train.batch_size = 64
    c.train.seed = 0
    c.train.log_every = 50
    c.train.logprob_chunk = 128

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 2000
    c.eval.split = "test"
    c.eval.path = ""  # held-out JSONL when data.source="jsonl"
    c.eval.num_examples = 1000  # the whole held-out split
    c.eval.num_samples = 8  # pass@8 at temperature 1: how much RL has to work with
    c.eval.temperature = 1.0
    c.eval.rewards = ml_collections.ConfigDict({"gsm8k": 1.0})
    c.eval.batch_size = 250
    c.eval.seed = 0
    return c
