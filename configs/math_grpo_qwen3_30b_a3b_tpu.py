"""GRPO on MATH with Qwen3-30B-A3B (mixture of experts) on a TPU v5p-64 slice, with
rollout routing replay.

    # on every host of the slice (see launch/tpu_pod.sh, which does this for you):
    python -m jaxrl_llm.train --config=configs/math_grpo_qwen3_30b_a3b_tpu.py \
        --workdir=gs://BUCKET/runs/math_grpo_qwen3_30b_a3b \
        --config.data.path=/data/math_train.jsonl --config.eval.path=/data/math_test.jsonl

Hardware: TPU v5p-64 (32 chips, 95 GB HBM each), 8 hosts. Model: 48 layers, 128 experts
of width 768 per layer, 8 per token (30.5B parameters, 3.3B active per token). Mesh:
`expert` = 8 (16 experts per chip group, the batch split 8 ways as well) x `fsdp` = 4
(the rest); bf16 parameters with float32 Adam moments, full remat of every layer.
Routing replay (`algo.routing_replay='rollout'`): the reference and update forwards
route each token to the experts the sampler chose, so the behaviour and training
log-probs agree (docs/moe.md); `moe/router_agreement` says how often they would have
differed.

Memory budget of the update, compiled (not run) for the full 48 layers on 32 fake host
devices of this mesh (XLA:CPU's buffer assignment for one device, an estimate of a
TPU's; many of its largest temporaries are float32 copies of bfloat16 activations, which
XLA:CPU makes to compute bf16 ops and a TPU does not: read them as an upper estimate),
per device:

    python benchmarks/moe_memory.py --moe-impl=gmm --set-mesh   # and --moe-impl=blocked

- arguments 16.87 GiB: bf16 parameters, float32 master copy and two Adam moments (14
  bytes a parameter). The experts are split 32 ways; the embeddings, attention and
  routers (1.5B parameters) only over fsdp = 4, replicated over `expert`. The outputs
  (the new state, 16.84 GiB) alias the donated arguments;
- temporaries 26.43 GiB with the TPU kernel (`moe_impl='gmm'`, what `auto` takes here:
  per device in `shard_map`; the update and log-prob programs trace under the mesh
  when its `expert` axis is > 1): 43.3 GiB in all, inside a
  v5p chip's 95 GB. The largest buffers are the MoE block's all-gathered (token, expert)
  rows: 8 x 2,047 tokens x k = 8 pairs of width 2,048 per device and micro-batch;
- temporaries 69.9 GiB with `blocked` under the partitioner (no mesh set): 86.8 GiB in
  all, the reason the kernel runs in `shard_map`. The partitioner does not split the sort-based
  dispatch by rows: every device holds the whole micro-batch's (token, expert) pairs
  (32 x 2,047 x 8 = 524,032 rows), and `blocked` gathers each block's expert weights
  (4,221 blocks, 6.2 GiB a projection in float32);
- `ragged` (XLA's grouped matmul, the portable path) could not be sized here:
  XLA:CPU expands `ragged_dot` over every expert (197 GiB of temporaries at 2 layers),
  which a TPU does not;
- not in the update: the reference's bf16 copy (2.4 GiB per device, its own program) and
  the sampler's KV cache.

Expected: eval/pass@1 on held-out MATH rises over the first hundred steps,
moe/router_agreement stays below 1 (the mismatch replay removes); not yet measured.

Target topology `v5p:2x4x4` (the slice above). Compiled for it by XLA:TPU (docs/tpu.md):
the sampler and the reference fit (10.19 and 7.28 GiB per chip at 48 layers); the
update, with the model cut to 4 and 8 layers, needs 15.23 and 16.78 GiB per chip at its peak (temporaries 11.96
and 12.28 GiB: 0.08 GiB more a layer), so ~32 GiB at 48 layers (16.84 GiB of arguments,
exact from the state's shardings, + ~15.5 of temporaries), a third of a chip's 95 GiB.
The full depth is not compiled here: XLA:TPU unrolls the layer loop and its compiler
memory grows ~0.8 GB a layer (9.8 GB at 8 layers), ~40 GB at 48. Predicted step
(roofline): 9.6 s, 7.4 of them the sampler's decoding. The step compiled for those chips
on any CPU machine with libtpu, nothing run:

    python -m jaxrl_llm.train --config=configs/math_grpo_qwen3_30b_a3b_tpu.py --compile_for=v5p:2x4x4
"""

from jaxrl_llm.config import base_config


def get_config():
    c = base_config()
    c.model.path = "Qwen/Qwen3-30B-A3B"
    c.model.dtype = "bfloat16"
    c.model.remat = "full"
    c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, -1, 8, 1
    c.data.source = "jsonl"
    c.data.path = "/data/math_train.jsonl"
    c.data.fields = {"question": "problem", "answer": "solution"}
    c.data.template = "{question}\nReason step by step and put the final answer in \\boxed{{}}."
    c.data.max_prompt_len = 512
    c.rollout.batch_size = 64
    c.rollout.num_generations = 8
    c.rollout.max_new_tokens = 2048
    c.algo.name = "grpo"
    c.algo.routing_replay = "rollout"
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.micro_batches = 16
    c.rewards = {"math": 1.0}
    c.train.num_steps = 300
    c.train.logprob_chunk = 256
    c.eval.every = 25
    c.eval.path = "/data/math_test.jsonl"
    c.checkpoint.every = 25
    c.checkpoint.keep = 2
    return c
