"""SFT: the loss against a PyTorch reference, a run that learns end to end, config errors,
the command line, the shipped tokenizer and the shipped quickstart model."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
import torch
import transformers
from hf_reference import VOCAB, hf_model

from jaxrl_llm import assets, models, rl, sft, verifiers
from jaxrl_llm import config as config_lib
from jaxrl_llm.assets import build_tokenizer
from jaxrl_llm.sft import config as sft_config
from jaxrl_llm.sft import data as sft_data
from jaxrl_llm.sft import trainer
from jaxrl_llm.trainer.metrics import read_metrics

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
# Greedy accuracy of the shipped model on the first 200 `arithmetic/digits_2` test prompts
# was 0.285 when it was built (docs/sft_and_quickstart_model.md); the margin allows for
# numerical differences between machines flipping a few close calls.
QUICKSTART_GREEDY_RANGE = (0.22, 0.35)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _reference_nll(model, prompts, completions) -> float:
    """Mean NLL of the completion tokens, each sequence run unpadded through PyTorch."""
    total, count = 0.0, 0
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double().numpy()
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        for t in range(len(p), len(p) + len(c)):  # token t is predicted at position t - 1
            total -= logp[t - 1, ids[0, t]]
            count += 1
    return total / count


def test_loss_is_completion_nll_of_the_pytorch_model(tmp_path):
    model = hf_model("llama", seed=3)
    model.save_pretrained(tmp_path)
    cfg, params = models.load_hf(tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 9, 3)]
    completions = [rng.integers(3, VOCAB, n).tolist() for n in (4, 1, 6)]
    batch = sft_data.make_sft_batch(prompts, completions, length=16, pad_id=0)
    loss, count = jax.jit(trainer.sft_loss, static_argnums=(0, 3))(cfg, params, batch, 4)
    assert int(count) == 11
    np.testing.assert_allclose(float(loss), _reference_nll(model, prompts, completions), rtol=1e-5)
    # The prompt tokens carry no loss: scoring them too would give another number.
    whole = [p + c for p, c in zip(prompts, completions, strict=True)]
    all_tokens = _reference_nll(model, [s[:1] for s in whole], [s[1:] for s in whole])
    assert abs(float(loss) - all_tokens) > 1e-2


def _load_config(name: str):
    path = os.path.join(CONFIGS, name)
    spec = importlib.util.spec_from_file_location(name[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _tiny_config(data_dir):
    """A new 2-layer model on the 8 fake devices (batch sharded over fsdp), trained and
    evaluated on the same 8 one-digit problems."""
    c = sft.default_config()
    c.model.tokenizer = assets.ARITHMETIC_TOKENIZER
    c.sft.new_model.update(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    c.data.update(
        name="arithmetic/digits_1",
        split="train[:8]",
        data_dir=data_dir,
        template="{question}=",
        max_prompt_len=20,
        pad_multiple=8,
    )
    c.sft.batch_size = 8
    c.sft.completion.max_len = 4
    c.optim.update(learning_rate=1e-2, warmup_steps=5)
    c.train.update(num_steps=40, log_every=1, verifier_workers=1)
    c.eval.update(every=40, split="train[:8]", num_prompts=8, pass_k=2)
    c.rollout.update(batch_size=8, max_new_tokens=4)
    return c


def test_run_learns_writes_metrics_and_a_transformers_model(tmp_path, data_dir):
    """40 steps memorize 8 answers: greedy pass@1 through the shared evaluation is 1; the
    exported directory gives `transformers` the same logits."""
    final = sft.run(_tiny_config(data_dir), str(tmp_path))
    lines = read_metrics(tmp_path / "metrics.jsonl")
    losses = [line["loss/nll"] for line in lines if "loss/nll" in line]
    assert [line["step"] for line in lines if "loss/nll" in line] == list(range(1, 41))
    assert losses[0] > 2.0 and losses[-1] < 0.05, losses  # from ~log(33 tokens) to memorized
    assert final["eval/pass@1"] == final["eval/pass@2"] == 1.0, final
    assert final["eval/num_prompts"] == 8 and final["eval/reward/gsm8k"] == 1.0
    assert os.listdir(tmp_path / "tensorboard")  # logging.tensorboard is on by default

    out = tmp_path / "hf"
    cfg, params = models.load_hf(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.eos_token_id == tokenizer.eos_token_id == 2
    ids = np.array([tokenizer("What is 12 + 34?=")["input_ids"]])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(models.logits(cfg, params, ids), expected, atol=1e-4)


def _set(config, name: str, value) -> None:
    *sections, key = name.split(".")
    for section in sections:
        config = config[section]
    config[key] = value


@pytest.mark.parametrize(
    "name,value,message",
    [
        (
            "optim.learning_rat",
            1e-3,
            r"optim\.learning_rat: unknown key; did you mean "
            r"optim\.learning_rate\?",
        ),
        (
            "sft.completion.maxlen",
            3,
            r"sft\.completion\.maxlen: unknown key; did you mean "
            r"sft\.completion\.max_len\?",
        ),
        ("algo", {"beta": 0.1}, r"^algo: a key of the RL trainer"),
        ("rollout.num_generations", 4, r"^rollout\.num_generations: a key of the RL trainer"),
        ("sft.batch_size", 12, r"^sft\.batch_size=12 is not divisible by mesh .* = 8"),
        ("rollout.batch_size", 4, r"^rollout\.batch_size=4 is not divisible by mesh"),
        ("optim.end_lr_ratio", 1.5, r"^optim\.end_lr_ratio=1\.5: must be in \[0, 1\]"),
        ("sft.completion.alt_prob", 0.5, r"^sft\.completion\.alt_template: empty"),
        ("model.tokenizer", "", r"^model\.tokenizer: required when model\.path is ''"),
        ("eval.correct_reward", "nope", r"^eval\.correct_reward='nope'"),
        ("data.max_prompt_len", 0, r"^data\.max_prompt_len must be >= 1"),
    ],
)
def test_config_errors_name_the_key(data_dir, name, value, message):
    c = _tiny_config(data_dir)
    sft.check_config(c)  # the unchanged config is valid
    _set(c, name, value)
    with pytest.raises(config_lib.ConfigError, match=message):
        sft.check_config(c)


def test_config_types_and_context_are_checked(data_dir):
    with pytest.raises(TypeError, match=r"num_steps"):  # ConfigDict types its fields
        _tiny_config(data_dir).train.num_steps = "10"
    plain = ml_collections.ConfigDict({"train": {"num_steps": "10"}})  # not from defaults
    with pytest.raises(config_lib.ConfigError, match=r"^train\.num_steps: expected int"):
        sft.check_config(plain)
    c = sft.check_config(_tiny_config(data_dir))
    sizes = dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    short = models.ModelConfig(
        "LlamaForCausalLM", 33, **sizes, head_dim=8, max_position_embeddings=23
    )
    with pytest.raises(config_lib.ConfigError, match=r"sft\.completion\.max_len = 24 exceeds"):
        sft_config.check_lengths(c, short)


def test_command_line_names_the_bad_key(tmp_path):
    """`python -m jaxrl_llm.sft`: a bad value and an unknown override, one line each."""
    config = os.path.join(CONFIGS, "sft_arithmetic.py")
    for override, expected in [
        ("--config.sft.completion.alt_prob=2.0", "error: sft.completion.alt_prob=2.0"),
        ("--config.algo.beta=0.1", "error: --config: bad override"),
    ]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxrl_llm.sft",
                f"--config={config}",
                f"--workdir={tmp_path}",
                override,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0
        assert expected in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_optimizer_is_the_rl_one_with_warmup_cosine_and_decay_by_name():
    """The `optim` section builds the RL optimizer: SFT's defaults are linear warmup then
    cosine to 0 (checked against the formula), and weight decay skips the stacked [L, D]
    norm scales (2-D like a matrix: the mask goes by name)."""
    optim = sft.default_config().optim
    optim.learning_rate, optim.warmup_steps, optim.weight_decay = 0.1, 4, 0.5
    opt = rl.optimizer_from_config(optim, num_steps=20)
    for s in (0, 2, 4, 9, 15, 20):
        expected = 0.1 * s / 4 if s < 4 else 0.05 * (1 + math.cos(math.pi * (s - 4) / 16))
        np.testing.assert_allclose(float(opt.schedule(s)), expected, rtol=1e-5, atol=1e-8)
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    params = {"layers": {"attn_norm": ones(2, 4), "q": ones(2, 4, 3)}}
    grads = jax.tree.map(np.zeros_like, params)  # Adam's direction is 0: only decay moves
    new, _ = opt.step(grads, opt.init(params), params, 0.1)
    np.testing.assert_allclose(new["layers"]["attn_norm"], 1.0)
    np.testing.assert_allclose(new["layers"]["q"], 1.0 - 0.1 * 0.5, rtol=1e-6)


def test_shipped_tokenizer_is_character_level_and_rebuilds_identically(tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets.ARITHMETIC_TOKENIZER)
    text = "What is 48 * -17?\n= -816 #### 3/4, (1.5)"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:] + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    build_tokenizer.build(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shipped = json.load(open(os.path.join(assets.ARITHMETIC_TOKENIZER, name)))
        assert json.load(open(tmp_path / name)) == shipped, name


def _reference_pass_at_1(batches, eos_id: int, max_new_tokens: int) -> float:
    """Greedy completions of the shipped model by `transformers`, checked by a plain rule:
    the completion's last integer equals the answer (a minus right after a digit is an
    operator: the repeated "-46-46" ends with 46)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(assets.QUICKSTART_MODEL).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets.QUICKSTART_MODEL)
    hits = []
    for batch in batches:
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor(batch.prompt_ids, dtype=torch.long),
                attention_mask=torch.tensor(batch.prompt_mask, dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        texts = tokenizer.batch_decode(
            out[:, batch.prompt_ids.shape[1] :], skip_special_tokens=True
        )
        for text, example in zip(texts, batch.examples, strict=True):
            numbers = re.findall(r"(?<!\d)-?\d+", text)
            hits.append(bool(numbers) and int(numbers[-1]) == int(example["answer"]))
    return float(np.mean(hits))


def test_shipped_quickstart_model_accuracy_matches_a_pytorch_reference(data_dir):
    """SFT's evaluation of the shipped model (the shared `evaluation.evaluate`) against
    transformers' greedy decoding, and inside its documented range. The reward's weight
    0.5 leaves correctness alone: a sample is correct when the verifier's raw score is
    above 0.5 (`evaluation.is_correct`), whatever the weighted total."""
    config = _load_config("sft_arithmetic.py")  # the run that made the model: same prompts
    config.data.data_dir = data_dir
    config.rewards = {"gsm8k": 0.5}
    config.eval.update(num_prompts=200, pass_k=1)
    config.rollout.batch_size = 200
    cfg, params = models.load_hf(assets.QUICKSTART_MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets.QUICKSTART_MODEL)
    with verifiers.VerifierPool(workers=1) as pool:
        held_out = trainer.held_out_eval(sft.check_config(config), cfg, tokenizer, pool)
        metrics = held_out(params, step=0)
    low, high = QUICKSTART_GREEDY_RANGE
    assert low <= metrics["eval/pass@1"] <= high, metrics
    reference = _reference_pass_at_1(held_out.batches, tokenizer.eos_token_id, 10)
    assert abs(metrics["eval/pass@1"] - reference) <= 0.01, (metrics, reference)
