"""SFT: the loss against a PyTorch reference, a short run end to end, the shipped tokenizer
and the shipped quickstart model."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from hf_reference import VOCAB, hf_model

from jaxrl_llm import assets, models, sft, sft_data, sft_eval, verifiers
from jaxrl_llm.assets import build_tokenizer

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
    loss, count = jax.jit(sft.sft_loss, static_argnums=(0, 3))(cfg, params, batch, 4)
    assert int(count) == 11
    np.testing.assert_allclose(float(loss), _reference_nll(model, prompts, completions), rtol=1e-5)
    # The prompt tokens carry no loss: scoring them too would give another number.
    whole = [p + c for p, c in zip(prompts, completions, strict=True)]
    all_tokens = _reference_nll(model, [s[:1] for s in whole], [s[1:] for s in whole])
    assert abs(float(loss) - all_tokens) > 1e-2


def _load_config(name: str):
    path = os.path.join(os.path.dirname(__file__), "..", "configs", name)
    spec = importlib.util.spec_from_file_location(name[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _tiny_config(data_dir):
    c = sft.default_config()
    c.tokenizer = assets.ARITHMETIC_TOKENIZER
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=16, max_position_embeddings=64)  # fmt: skip
    c.data.update(name="arithmetic/digits_2", data_dir=data_dir, template="{question}",
                  max_prompt_len=20, pad_multiple=8)  # fmt: skip
    c.completion.max_len = 6
    c.train.update(num_steps=3, batch_size=8, log_every=1)
    c.optim.warmup_steps = 1
    c.eval.update(num_examples=8, num_samples=2, batch_size=8)
    return c


def test_short_run_writes_metrics_and_a_transformers_model(tmp_path, data_dir):
    """3 steps on the 8 fake devices (batch sharded over fsdp), eval, export."""
    final = sft.run(_tiny_config(data_dir), str(tmp_path))
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [line["step"] for line in lines if "loss/nll" in line] == [1, 2, 3]
    assert all(np.isfinite(line["loss/nll"]) for line in lines if "loss/nll" in line)
    assert {"eval/pass@1", "eval/pass@2", "eval/completion_len"} <= set(lines[-1])
    assert final["eval/num_examples"] == 8

    out = tmp_path / "hf"
    cfg, params = models.load_hf(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.eos_token_id == tokenizer.eos_token_id == 2
    ids = np.array([tokenizer("What is 12 + 34?")["input_ids"]])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(models.logits(cfg, params, ids), expected, atol=1e-4)


def test_config_errors_name_the_key(data_dir):
    c = _tiny_config(data_dir)
    c.optim.lr = 1e-3
    with pytest.raises(sft.ConfigError, match=r"^optim\.lr: unknown key"):
        sft.check_config(c)
    c = _tiny_config(data_dir)
    c.train.batch_size = 12  # 8 devices
    with pytest.raises(sft.ConfigError, match=r"^train\.batch_size=12: not divisible"):
        sft.check_config(c)
    c = _tiny_config(data_dir)
    c.optim.end_lr_ratio = 1.5
    with pytest.raises(sft.ConfigError, match=r"^optim\.end_lr_ratio: must be in \[0, 1\]"):
        sft.check_config(c)
    c = _tiny_config(data_dir)
    with pytest.raises(TypeError, match=r"num_steps"):  # ConfigDict types its fields
        c.train.num_steps = "10"


def test_optimizer_decays_matrices_not_stacked_norm_scales(data_dir):
    """The stacked [L, D] norm scales are 2-D like a matrix: the decay mask goes by name."""
    optim = _tiny_config(data_dir).optim
    optim.learning_rate, optim.warmup_steps, optim.weight_decay = 0.1, 0, 0.5
    opt = sft.make_optimizer(optim, num_steps=10)
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    params = {"layers": {"attn_norm": ones(2, 4), "q": ones(2, 4, 3)}}
    grads = jax.tree.map(np.zeros_like, params)  # Adam's direction is 0: only decay moves
    new, _ = opt.step(grads, opt.init(params), params, opt.schedule(0))
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


def test_shipped_quickstart_model_accuracy_is_in_its_documented_range(data_dir):
    """Catches a regression in the asset (or in the model code that reads it)."""
    cfg, params = models.load_hf(assets.QUICKSTART_MODEL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(assets.QUICKSTART_MODEL)
    config = _load_config("sft_arithmetic.py")  # the run that made the model: same prompts
    config.data.data_dir = data_dir
    eval_set = sft_eval.load_eval_set(config.data, tokenizer, "test", 200)
    with verifiers.VerifierPool(workers=1) as pool:
        metrics = sft_eval.evaluate(
            cfg, params, tokenizer, eval_set, pool, config.eval.rewards,
            max_new_tokens=config.completion.max_len,
        )  # fmt: skip
    low, high = QUICKSTART_GREEDY_RANGE
    assert low <= metrics["eval/pass@1"] <= high, metrics
