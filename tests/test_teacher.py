"""On-policy distillation: teacher log-probs, the distillation advantage, the tokenizer check.

- the advantage against a numpy loop (group-normalised task reward + w (log pi_T - log pi_S));
- the teacher's log-probs in a run equal its own forward in HF PyTorch (<= 1e-5);
- a teacher equal to the student gives no distillation signal;
- a teacher with another tokenizer is one ConfigError line, before any weight is read.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_run import TOKENIZER, make_model_dir, tiny_config, tiny_model_config

from jaxrl_llm import assets, config, models, rl
from jaxrl_llm.trainer import perf
from jaxrl_llm.trainer.metrics import read_metrics
from jaxrl_llm.trainer.run import Run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _numpy_grpo_distill(rewards, mask, teacher, student, G, coef, eps=1e-6):
    n, t = mask.shape
    adv = np.zeros((n, t))
    for i in range(n):
        group = rewards[(i // G) * G : (i // G + 1) * G]
        std = np.std(group, ddof=1)
        a = 0.0 if std == 0 else (rewards[i] - group.mean()) / (std + eps)
        for j in range(t):
            if mask[i, j]:
                adv[i, j] = a + coef * (teacher[i, j] - student[i, j])
    return adv


@pytest.mark.parametrize("coef", [0.5, 2.0])
def test_distillation_advantage_matches_numpy_loop(coef):
    rng = np.random.default_rng(0)
    G, n, t = 4, 8, 6
    rewards = rng.integers(0, 2, n).astype(np.float32)
    rewards[4:] = 1.0  # an all-equal group: only the teacher term remains
    mask = rng.random((n, t)) > 0.2
    teacher = rng.normal(-2, 1, (n, t)).astype(np.float32)
    student = rng.normal(-2, 1, (n, t)).astype(np.float32)
    cfg = rl.preset("grpo", distill_coef=coef)
    got = rl.compute_advantages(
        cfg,
        jnp.asarray(rewards),
        jnp.asarray(mask),
        G,
        teacher_logp=jnp.asarray(teacher),
        behaviour_logp=jnp.asarray(student),
    ).advantages
    want = _numpy_grpo_distill(rewards, mask, teacher, student, G, coef)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="teacher_logp"):
        rl.compute_advantages(cfg, jnp.asarray(rewards), jnp.asarray(mask), G)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    student = make_model_dir(str(root / "student"))
    teacher_cfg = tiny_model_config(  # another model: wider, larger weights, own seed
        vocab_size=33,
        hidden_size=48,
        intermediate_size=96,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        initializer_range=0.3,
    )
    teacher = str(root / "teacher")
    models.save_hf(
        teacher_cfg, models.init_params(teacher_cfg, seed=7), teacher, tokenizer_dir=TOKENIZER
    )
    return student, teacher


def _run(student, teacher_path, tmp_path, weight=0.5):
    c = tiny_config(student, beta=0.0)
    c.rewards = {"format": {"weight": 1.0, "options": {"pattern": "[0-9].*"}}}
    c.teacher.path, c.teacher.weight = teacher_path, weight
    return Run.build(c, str(tmp_path))


def _hf_completion_logprobs(path, out, temperature):
    """log pi(o_t) of every completion token by the HF PyTorch model at `path`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = np.concatenate([np.asarray(out.prompt_tokens), np.asarray(out.tokens)], axis=1)
    mask = np.concatenate([np.asarray(out.prompt_mask), np.asarray(out.mask)], axis=1)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions),
        ).logits.double()
    P = out.prompt_tokens.shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : -1] / temperature, dim=-1)
    tokens = torch.tensor(np.asarray(out.tokens))
    return logp.gather(-1, tokens[..., None])[..., 0].numpy()


def test_several_teachers_chosen_by_a_data_field(dirs, tmp_path):
    """The teacher's log-probs in a run equal its own HF PyTorch forward, with two
    teachers chosen by teacher.field='answer': rows whose answer is even are scored by
    the wide teacher (teacher.paths, ten names for one model: loaded once), the others
    by teacher.path (here the student)."""
    student, teacher = dirs
    c = tiny_config(student, beta=0.0)
    c.rewards = {"format": {"weight": 1.0, "options": {"pattern": "[0-9].*"}}}
    c.teacher.path, c.teacher.field = student, "answer"
    c.teacher.paths = {str(k): teacher for k in range(0, 19, 2)}
    run = Run.build(c, str(tmp_path))
    try:
        assert len(run.teachers) == 2  # one load per distinct path
        with run.transfer_guard():
            ro = run.source.next(0, run.sampler_params(), perf.PhaseClock())
            got = np.asarray(run.teacher(ro))
        G = ro.out.num_generations
        even = np.array([int(ex["answer"]) % 2 == 0 for ex in ro.batch.examples for _ in range(G)])
        assert 0 < even.sum() < len(even)  # both teachers serve rows of this batch
        np.testing.assert_array_equal(run.teacher_rows(ro), np.where(even, 1, 0))
        t = run.spec.logprob_temperature
        want = np.where(
            even[:, None],
            _hf_completion_logprobs(teacher, ro.out, t),
            _hf_completion_logprobs(student, ro.out, t),
        )
        valid = np.asarray(ro.out.loss_mask)
        assert valid.sum() > 10
        np.testing.assert_allclose(got[valid], want[valid], atol=1e-5, rtol=0)
        gap = np.abs(np.asarray(ro.out.logprobs) - want)[valid & even[:, None]]
        assert np.mean(gap) > 0.1  # the wide teacher is another model: a real signal
    finally:
        run.close()


def test_teacher_equal_to_student_gives_no_signal(dirs, tmp_path):
    """The command line with teacher.path = model.path: the teacher's program is compiled
    before the first step beside the others (no compile inside a step), and at step 0,
    where teacher and student are one model, the distillation signal is 0 (the teacher's
    log-probs are the sampler's up to float rounding); at step 1 the student has moved."""
    student, _ = dirs
    env = dict(
        os.environ,
        TINY_MODEL_DIR=student,
        PYTHONPATH=os.pathsep.join([ROOT, HERE]),
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxrl_llm.train",
            f"--config={HERE}/tiny_run.py",
            f"--workdir={tmp_path / 'run'}",
            "--config.mesh.fsdp=1",
            "--config.mesh.tensor=1",
            f"--config.teacher.path={student}",
            "--config.algo.beta=0.0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Compiled, or loaded from the test session's compilation cache.
    done = r"(?:compiling|loading) (\w+)[^\n]*\.\.\. \d"  # a program's line once built
    lines = [m.group(1) for m in re.finditer(done, proc.stderr)]
    assert lines == ["sampler", "teacher", "update"], lines
    first, second = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert first["perf/compile_s"] == second["perf/compile_s"] == 0.0
    assert abs(first["distill/reverse_kl"]) < 1e-6, first["distill/reverse_kl"]
    assert abs(second["distill/reverse_kl"]) > abs(first["distill/reverse_kl"])


def test_teacher_with_another_tokenizer_is_one_line(dirs, tmp_path):
    student, _ = dirs
    other = str(tmp_path / "other_tokenizer_teacher")
    cfg = tiny_model_config(vocab_size=64, tie_word_embeddings=True)
    tok = os.path.join(os.path.dirname(assets.__file__), "calculator_tokenizer")
    models.save_hf(cfg, models.init_params(cfg, seed=0), other, tokenizer_dir=tok)
    with pytest.raises(config.ConfigError) as err:
        _run(student, other, tmp_path / "run")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"teacher.path={other!r}")
    assert "tokenizer" in message


def test_teacher_config_checks(dirs):
    student, teacher = dirs
    c = tiny_config(student)
    c.teacher.path, c.teacher.weight = teacher, -1.0
    with pytest.raises(config.ConfigError, match=r"^teacher.weight=-1.0: must be"):
        config.prepare(c, devices=jax.devices())
    c.teacher.path = "/nonexistent/teacher"
    with pytest.raises(config.ConfigError, match="teacher.path"):
        config.prepare(c, devices=jax.devices())
    c.teacher.path, c.teacher.weight, c.teacher.field = teacher, 1.0, "topic"
    with pytest.raises(config.ConfigError, match="several teachers need both"):
        config.prepare(c, devices=jax.devices())
    c.teacher.field = ""
    c.algo.distill_coef = 1.0  # set through teacher.weight only
    with pytest.raises(config.ConfigError, match="algo.distill_coef: unknown key"):
        config.prepare(c, devices=jax.devices())
