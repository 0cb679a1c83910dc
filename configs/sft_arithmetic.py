r"""SFT of the quickstart model (`jaxrl_llm/assets/quickstart_model`): a 0.14M-parameter
Llama-style decoder trained from scratch on `arithmetic/digits_2` (+, -, * on two-digit
numbers), with a deliberate flaw for RL to fix.

    python -m jaxrl_llm.sft --config=configs/sft_arithmetic.py --workdir=/tmp/sft_arithmetic
    cp /tmp/sft_arithmetic/hf/* jaxrl_llm/assets/quickstart_model/   # to update the asset

Hardware: CPU (a laptop, or 2 shared cores); nothing is downloaded (the data is generated
locally, the tokenizer ships in `jaxrl_llm/assets/arithmetic_tokenizer`).

Expected result: 8000 steps in ~11 minutes on 2 shared CPU cores (bit-identical reruns on
one machine); on the 1000 held-out prompts greedy pass@1 0.28 and pass@8 (temperature 1)
0.61, greedy completions 5.3 tokens (EOS included). Greedy repeats the answer ("6565") on
25% of the prompts; its digits are right on 53% (+ 92%, - 61%, * 3%). GRPO from it
(configs/quickstart.py, learning rate 1e-4, 32 prompts x 8) reaches ~0.50 in 2 minutes.

Why the flaw: an honestly under-trained model lacks arithmetic, which one bit of reward per
sample teaches slowly (GRPO moved such a model by -5..+3 points in 5 minutes). Half of the
answers here repeat themselves, as a model that never learned to stop would; the gsm8k
check scores them 0, so sampled groups have mixed rewards and RL has a habit to remove.
See docs/sft_and_quickstart_model.md.
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
    # model imitates it (greedy decoding stops or repeats, depending on the prompt), so its
    # arithmetic is better than its reward and sampled groups hold both endings.
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
