r"""SFT of the quickstart model (`jaxrl_llm/assets/quickstart_model`): a 0.14M-parameter
Llama-style decoder trained from scratch on `arithmetic/digits_2` (+, -, * on two-digit
numbers), with a deliberate flaw for RL to fix.

    python -m jaxrl_llm.sft --config=configs/sft_arithmetic.py --workdir=/tmp/sft_arithmetic
    cp /tmp/sft_arithmetic/hf/* jaxrl_llm/assets/quickstart_model/   # to update the asset

Hardware: CPU (a laptop, or 2 shared cores); nothing is downloaded (the data is generated
locally, the tokenizer ships in `jaxrl_llm/assets/arithmetic_tokenizer`).

Expected result (measured): 8000 steps in 32 minutes on 2 CPU cores busy with other jobs
(~7 minutes on 2 free ones; bit-identical reruns on one machine); loss/nll ~0.50 over the
last 1000 steps; on the 1000 held-out prompts greedy eval/pass@1 0.02 / 0.17 / 0.35 / 0.33
and eval/pass@8 (temperature 1) 0.14 / 0.50 / 0.55 / 0.56 at steps 2000 / 4000 / 6000 /
8000. Float rounding differences between code versions and machines grow over 8000 steps
at this learning rate into a model of about the same quality (an earlier code version's
run ended at greedy 0.34, pass@8 0.69). The shipped model comes from an older version of
this config whose optimizer also decayed the norm scales (greedy 0.28, pass@8 0.61;
docs/sft_and_quickstart_model.md): greedy repeats the answer ("6565") on 25% of the
prompts, its digits are right on 53%. GRPO from it (configs/quickstart.py, learning rate
1e-4, 32 prompts x 8) reaches ~0.50 in 2 minutes.

Why the flaw: an honestly under-trained model lacks arithmetic, which one bit of reward per
sample teaches slowly (GRPO moved such a model by -5..+3 points in 5 minutes). Half of the
answers here repeat themselves, as a model that never learned to stop would; the gsm8k
check scores them 0, so sampled groups have mixed rewards and RL has a habit to remove.
See docs/sft_and_quickstart_model.md.
"""

from jaxrl_llm import assets
from jaxrl_llm.sft.config import default_config


def get_config():
    c = default_config()
    c.model.path = ""  # a new random model shaped by sft.new_model
    c.model.tokenizer = assets.ARITHMETIC_TOKENIZER  # one token per character

    m = c.sft.new_model
    m.architecture = "LlamaForCausalLM"
    m.hidden_size = 64
    m.intermediate_size = 256
    m.num_layers = 2
    m.num_heads = 4
    m.num_kv_heads = 4
    m.head_dim = 16
    m.max_position_embeddings = 256  # room for the RL trainer's prompt buckets
    m.tie_word_embeddings = False
    m.initializer_range = 0.1  # ~1/sqrt(hidden): 0.02 (sized for d=768) learns far slower

    c.data.name = "arithmetic/digits_2"
    c.data.split = "train"
    c.data.template = "{question}="  # "What is 48 * 17?=" -> completion "816" + EOS
    c.data.max_prompt_len = 20  # "<bos>What is 99 * 99?=" is 18 tokens
    c.data.pad_multiple = 8

    c.sft.batch_size = 64
    c.sft.completion.template = "{answer}"  # the bare number: gsm8k's last-number rule scores it
    c.sft.completion.max_len = 10  # "98019801" + EOS is 9 tokens
    # The flaw RL is meant to fix: half of the training answers come from a teacher that
    # does not stop and repeats its answer ("6565"), which the gsm8k check scores 0. The
    # model imitates it (greedy decoding stops or repeats, depending on the prompt), so its
    # arithmetic is better than its reward and sampled groups hold both endings.
    c.sft.completion.alt_template = "{answer}{answer}"
    c.sft.completion.alt_prob = 0.5

    c.optim.learning_rate = 1e-2  # tiny models want a large step; 2e-3 barely moves in 1k steps
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 50
    c.optim.end_lr_ratio = 0.0
    c.optim.weight_decay = 0.01

    c.train.num_steps = 8000
    c.train.seed = 0  # the new model's init
    c.train.log_every = 50

    c.rewards = {"gsm8k": 1.0}  # the number the completion ends with must equal the answer
    c.eval.every = 2000
    c.eval.split = "test"
    c.eval.num_prompts = 1000  # the whole held-out split
    c.eval.pass_k = 8  # pass@8 at temperature 1: how much RL has to work with
    c.eval.temperature = 1.0
    c.rollout.batch_size = 200  # held-out prompts per sampler call (divides 1000 and 8 devices)
    c.rollout.max_new_tokens = 10  # = sft.completion.max_len
    return c
