"""Speed settings picked at start-up for the backend, where the config leaves them unset.

    config, line = tuning.resolve(config, model_cfg, jax.default_backend())
    # line: "cpu defaults: micro_batches=4 (32 rows x 88 tokens: 8.2 MiB per MLP
    #        activation), logprob_chunk=32, scan_layers=False (4 layers), bucket_steps=4"

Four keys default to None in `config_lib.base_config()`; a value set in the config (an
experiment file or `--config.KEY=...`) is never changed. None of them changes what is
computed, only how fast and in how much memory:

| key | CPU | GPU / TPU |
|---|---|---|
| `optim.micro_batches` | the fewest that fit the budgets below | 1 |
| `train.logprob_chunk` | `CPU_LOGPROB_CHUNK` (32) | 128 |
| `model.scan_layers` | False up to `CPU_UNROLL_MAX_LAYERS` (8) layers | True |
| `rollout.bucket_steps` | 4 | 2 |

CPU micro-batches: k divides the rows of an optimizer step (batch_size x num_generations
/ mini_batches), and a micro-batch's rows on one device hold at most
`CPU_ACTIVATION_BYTES` per float32 MLP activation (rows x (prompt bucket +
max_new_tokens) x intermediate_size) and at most `SAVE_LOGITS_BYTES` of logits (rows x
max_new_tokens x vocab_size).

Why on CPU: a micro-batch whose activations stay in the last-level cache runs faster and
faults in fewer fresh pages, and one whose logits are small enough keeps them for the
backward instead of recomputing them (`rl.logprobs.SAVE_LOGITS_BYTES`); unrolled layers
let the backward read each layer's residuals in place (compile time grows with depth, so
only shallow models are unrolled); finer prompt buckets pad less. The measurements behind
the rules are in benchmarks/RESULTS.md ("Fast by default").

The trainer records the values it picked in the workdir's config.json; the rules depend
only on the config, the model and the backend, so a resume on the same kind of machine
picks the same ones (a resume elsewhere lists the differences: `workdir.check_resume`).
"""

from __future__ import annotations

import copy

import ml_collections

from jaxrl_llm.rl.logprobs import SAVE_LOGITS_BYTES
from jaxrl_llm.sampling import bucket_length

KEYS = ("optim.micro_batches", "train.logprob_chunk", "model.scan_layers", "rollout.bucket_steps")
CPU_ACTIVATION_BYTES = 16 * 2**20  # one float32 MLP activation of a micro-batch, per device
CPU_LOGPROB_CHUNK = 32
CPU_UNROLL_MAX_LAYERS = 8
ACCELERATOR = {
    "optim.micro_batches": 1,
    "train.logprob_chunk": 128,
    "model.scan_layers": True,
    "rollout.bucket_steps": 2,
}


def _get(config, key: str):
    section, name = key.split(".")
    return config[section][name]


def bucket_steps(config, backend: str) -> int:
    """`rollout.bucket_steps` as the run will use it."""
    steps = config.rollout.bucket_steps
    if steps is not None:
        return steps
    return 4 if backend == "cpu" else ACCELERATOR["rollout.bucket_steps"]


def micro_batches(config, model_cfg, batch_shards: int = 1) -> tuple[int, str]:
    """(the fewest micro-batches k that fit the CPU budgets, why). k divides the rows per
    optimizer step, and each micro-batch's rows divide over the `batch_shards` devices."""
    r, o = config.rollout, config.optim
    rows = r.batch_size * r.num_generations // o.mini_batches
    seq = bucket_length(config.data.max_prompt_len, bucket_steps(config, "cpu"))
    seq += r.max_new_tokens
    row_bytes = seq * model_cfg.intermediate_size * 4  # one MLP activation, float32
    logit_bytes = r.max_new_tokens * model_cfg.vocab_size * 4
    fits = [
        k
        for k in range(1, rows + 1)
        if rows % k == 0
        and (rows // k) % batch_shards == 0
        and rows // k // batch_shards * row_bytes <= CPU_ACTIVATION_BYTES
        and rows // k // batch_shards * logit_bytes <= SAVE_LOGITS_BYTES
    ]
    if not fits:  # one row per device is the least a micro-batch can hold
        k = max(k for k in range(1, rows + 1) if rows % k == 0 and (rows // k) % batch_shards == 0)
    else:
        k = fits[0]
    per_device = rows // k // batch_shards
    mib = per_device * row_bytes / 2**20
    return k, f"{rows // k} rows x {seq} tokens: {mib:.1f} MiB per MLP activation"


def picks(config, model_cfg, backend: str, batch_shards: int = 1) -> dict[str, tuple]:
    """key -> (value, why) for every tuning key, by the rules of the module doc."""
    if backend != "cpu":
        return {k: (v, "") for k, v in ACCELERATOR.items()}
    layers = model_cfg.num_layers
    return {
        "optim.micro_batches": micro_batches(config, model_cfg, batch_shards),
        "train.logprob_chunk": (CPU_LOGPROB_CHUNK, ""),
        "model.scan_layers": (layers > CPU_UNROLL_MAX_LAYERS, f"{layers} layers"),
        "rollout.bucket_steps": (bucket_steps(config, backend), ""),
    }


def resolve(
    config: ml_collections.ConfigDict,
    model_cfg,
    backend: str,
    *,
    batch_shards: int = 1,
) -> tuple[ml_collections.ConfigDict, str]:
    """-> (a copy of `config` with every unset tuning key set, one line saying what was
    picked and why; "" when the config set them all).

    batch_shards: the devices the batch is split over (mesh data x fsdp x expert)."""
    resolved = copy.deepcopy(config)
    unset = [k for k in KEYS if _get(config, k) is None]
    line = ""
    if unset:
        chosen = picks(config, model_cfg, backend, batch_shards)
        said = []
        for key in unset:
            value, why = chosen[key]
            section, name = key.split(".")
            resolved[section][name] = value
            said.append(f"{name}={value}" + (f" ({why})" if why else ""))
        line = f"{backend} defaults: " + ", ".join(said)
    warning = unsplit_rows(resolved, batch_shards)
    return resolved, "; ".join(x for x in (line, warning) if x)


def unsplit_rows(config, batch_shards: int) -> str:
    """A warning when a micro-batch's rows do not divide over the `batch_shards` devices
    of the batch axes (they are then replicated: every device runs every row of each
    micro-batch, its activations and time multiplied), naming the micro-batch count that
    gives one row or more per device; "" when they divide."""
    r, o = config.rollout, config.optim
    per_step = r.batch_size * r.num_generations // max(o.mini_batches, 1)
    rows = per_step // max(o.micro_batches or 1, 1)
    if batch_shards <= 1 or rows % batch_shards == 0:
        return ""
    fits = [
        k for k in range(1, per_step + 1) if per_step % k == 0 and per_step // k % batch_shards == 0
    ]
    fix = (
        f"optim.micro_batches={fits[-1]} gives {per_step // fits[-1] // batch_shards} row(s) "
        "per device"
        if fits
        else "the rows of an optimizer step do not divide over them either"
    )
    return (
        f"warning: optim.micro_batches={o.micro_batches} leaves {rows} rows per micro-batch, "
        f"which do not split over the {batch_shards} devices of the batch axes (mesh data x "
        f"fsdp x expert): each device runs all {rows} rows of every micro-batch; {fix}"
    )
