"""The speed settings picked at start-up (`jaxrl_llm.tuning`): the rules against a table
worked out by hand, explicit settings left alone, what the trainer records."""

import pytest
from tiny_run import tiny_model_config

from jaxrl_llm import config as config_lib
from jaxrl_llm.config import ConfigError, tuning

W1 = dict(intermediate_size=768, vocab_size=512, num_layers=4)


def _config(batch=16, generations=8, prompt=24, new=64, mini=1):
    c = config_lib.base_config()
    c.rollout.batch_size, c.rollout.num_generations = batch, generations
    c.data.max_prompt_len, c.rollout.max_new_tokens = prompt, new
    c.optim.mini_batches = mini
    return c


# Each row: (rollout and model settings, backend, batch shards) -> expected values. The
# arithmetic: rows = batch x G / mini; seq = bucket(prompt, 4 steps) + new; a micro-batch
# holds rows/k/shards rows; each row costs seq x intermediate x 4 bytes of MLP activation
# (budget 16 MiB = 16,777,216) and new x vocab x 4 bytes of logits (budget 512 MiB).
CASES = [
    # W1: 128 rows, seq 24 + 64 = 88, 270,336 B/row -> at most 62 rows -> 32 rows, k = 4.
    (dict(), W1, "cpu", 1, dict(micro=4, chunk=32, scan=False, steps=4)),
    # 25M benchmark: bucket(64) = 64, seq 128, 524,288 B/row -> 32 rows -> k = 4; logits
    # 32 x 64 x 32768 x 4 = 256 MiB fit.
    (
        dict(prompt=64),
        dict(intermediate_size=1024, vocab_size=32768, num_layers=8),
        "cpu",
        1,
        dict(micro=4, chunk=32, scan=False, steps=4),
    ),
    # Quickstart: 256 rows, bucket(20) = 20, seq 30, 30,720 B/row: all 256 rows fit, k = 1.
    (
        dict(batch=32, prompt=20, new=10),
        dict(intermediate_size=256, vocab_size=33, num_layers=2),
        "cpu",
        1,
        dict(micro=1, chunk=32, scan=False, steps=4),
    ),
    # A large vocabulary binds: 256 x 151936 x 4 = 155.6 MB of logits per row -> at most 3
    # rows of the 64 -> 2 rows, k = 32 (activations: 272 x 256 x 4 B/row, no limit here).
    (
        dict(batch=8, prompt=16, new=256),
        dict(intermediate_size=256, vocab_size=151936, num_layers=12),
        "cpu",
        1,
        dict(micro=32, chunk=32, scan=True, steps=4),
    ),
    # W1 over 4 devices: 32 rows per device fit at once, k = 1.
    (dict(), W1, "cpu", 4, dict(micro=1, chunk=32, scan=False, steps=4)),
    # W1 in 2 mini-batches: 64 rows per optimizer step -> 32 rows, k = 2.
    (dict(mini=2), W1, "cpu", 1, dict(micro=2, chunk=32, scan=False, steps=4)),
    # 8 layers are still unrolled, 9 are scanned.
    (dict(), W1 | dict(num_layers=8), "cpu", 1, dict(micro=4, chunk=32, scan=False, steps=4)),
    (dict(), W1 | dict(num_layers=9), "cpu", 1, dict(micro=4, chunk=32, scan=True, steps=4)),
    # GPU / TPU: the previous defaults whatever the shapes.
    (dict(), W1, "gpu", 1, dict(micro=1, chunk=128, scan=True, steps=2)),
    (dict(batch=8, new=256), W1, "tpu", 4, dict(micro=1, chunk=128, scan=True, steps=2)),
]


@pytest.mark.parametrize("rollout,model,backend,shards,expected", CASES)
def test_rules_against_a_table(rollout, model, backend, shards, expected):
    c = _config(**rollout)
    resolved, line = tuning.resolve(c, tiny_model_config(**model), backend, batch_shards=shards)
    got = dict(
        micro=resolved.optim.micro_batches,
        chunk=resolved.train.logprob_chunk,
        scan=resolved.model.scan_layers,
        steps=resolved.rollout.bucket_steps,
    )
    assert got == expected
    assert line.startswith(f"{backend} defaults: micro_batches={expected['micro']}")
    assert f"scan_layers={expected['scan']}" in line
    assert c.optim.micro_batches is None  # the input config is not changed


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_explicit_settings_are_never_overridden(backend):
    c = _config()
    c.optim.micro_batches, c.train.logprob_chunk = 2, 64
    c.model.scan_layers, c.rollout.bucket_steps = True, 8
    resolved, line = tuning.resolve(c, tiny_model_config(**W1), backend)
    assert (resolved.optim.micro_batches, resolved.train.logprob_chunk) == (2, 64)
    assert (resolved.model.scan_layers, resolved.rollout.bucket_steps) == (True, 8)
    assert line == ""
    c.model.scan_layers = None  # one left unset: only it is picked and reported
    resolved, line = tuning.resolve(c, tiny_model_config(**W1), backend)
    assert resolved.optim.micro_batches == 2 and resolved.rollout.bucket_steps == 8
    assert line == f"{backend} defaults: scan_layers={backend != 'cpu'}" + (
        " (4 layers)" if backend == "cpu" else ""
    )


def test_a_micro_batch_that_does_not_split_over_the_devices_is_named():
    """The 16k config's 256 rows in 16 micro-batches split over 16 chips; over 32 chips
    each micro-batch's 16 rows would be replicated (every chip runs all of them): the line
    says so and names the micro-batch count that splits."""
    c = _config(batch=32, generations=8)
    c.optim.micro_batches, c.train.logprob_chunk = 16, 256
    c.model.scan_layers, c.rollout.bucket_steps = True, 2
    model = tiny_model_config(**W1)
    assert tuning.resolve(c, model, "tpu", batch_shards=16)[1] == ""
    _, line = tuning.resolve(c, model, "tpu", batch_shards=32)
    assert line == (
        "warning: optim.micro_batches=16 leaves 16 rows per micro-batch, which do not split "
        "over the 32 devices of the batch axes (mesh data x fsdp x expert): each device runs "
        "all 16 rows of every micro-batch; optim.micro_batches=8 gives 1 row(s) per device"
    )
    c.optim.micro_batches = None  # picked: the picks split, so no warning joins the line
    assert "warning" not in tuning.resolve(c, model, "cpu", batch_shards=32)[1]


def test_micro_batches_always_divide_the_rows():
    for batch in (1, 2, 3, 6, 16, 24):
        for generations in (1, 4, 7, 16):
            for shards in (1, 2, 4):
                if batch % shards:
                    continue
                c = _config(batch=batch, generations=generations, prompt=200, new=300)
                model = tiny_model_config(intermediate_size=8192, vocab_size=65536)
                k, _ = tuning.micro_batches(c, model, shards)
                rows = batch * generations
                assert rows % k == 0 and (rows // k) % shards == 0, (batch, generations, shards)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("optim.micro_batches", 0, r"optim\.micro_batches=0 does not divide the 64 rows"),
        ("train.logprob_chunk", 0, r"train\.logprob_chunk=0: must be >= 1"),
        ("rollout.bucket_steps", 3, r"rollout\.bucket_steps=3: expected one of"),
    ],
)
def test_bad_explicit_values_name_the_key(key, value, message):
    c = config_lib.base_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(c, num_devices=1)


def test_unset_values_pass_validation():
    c = config_lib.base_config()
    c.data.max_prompt_len = 64  # the shipped model's context is 256
    assert all(tuning._get(c, key) is None for key in tuning.KEYS)
    config_lib.validate(c, num_devices=1)
