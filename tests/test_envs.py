"""Environments on the host: registry, worker isolation, the built-ins, rendering, config."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from tiny_run import TOKENIZER

from jaxrl_llm import config as config_lib
from jaxrl_llm import envs
from jaxrl_llm.envs import calculator, schedule
from jaxrl_llm.envs.python_tool import PythonTool

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_ENVS = os.path.join(HERE, "envs_for_tests.py")


def test_registry_names_builtins_files_and_refuses_unknown():
    assert isinstance(envs.get("calculator"), calculator.Calculator)
    assert envs.get(f"{TEST_ENVS}:Scripted", turns=2).turns == 2
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        envs.get("nope")
    with pytest.raises(ValueError, match="has no option 'turn'; its options: turns"):
        envs.get(f"{TEST_ENVS}:Scripted", turn=2)
    with pytest.raises(ValueError, match="'Missing' is not a class with a step method"):
        envs.resolve(f"{TEST_ENVS}:Missing")


@pytest.mark.parametrize(
    "expression,value",
    [("12 * 59", 708), ("(3 + 4) * -2", -14), ("7 / 2", 3.5), ("2 ** 10", 1024), ("17 % 5", 2)],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator.evaluate(expression) == value


@pytest.mark.parametrize(
    "expression,why",
    [
        ("__import__('os').system('ls')", "Call is not allowed"),
        ("(1).__class__", "Attribute is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("9 ** 9 ** 9", "exponent above"),
        ("10 ** 40", "too large"),
        ("1 / 0", "division by zero"),
        ("'a' * 3", "Constant is not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("1+" * 200 + "1", "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression, why):
    with pytest.raises(ValueError, match=why):
        calculator.evaluate(expression)


def test_calculator_env_turns_and_final_answer():
    env = envs.get("calculator")
    assert env.reset({"answer": "708"}) is None
    step = env.step("I compute <calc>12*59</calc>")
    assert (step.observation, step.done, step.info) == ("708", False, {"tool_calls": 1.0})
    step = env.step("<calc>12*x</calc>")
    assert step.observation.startswith("error: Name") and step.info["tool_errors"] == 1.0
    final = env.step("12 * 59 = 708\n#### 708")
    assert final.done and final.reward == 1.0


def test_guess_number_answers_higher_lower_and_rewards_few_guesses():
    env = envs.get("guess_number", low=1, high=100, decay=0.5)
    assert "between 1 and 100" in env.reset({"secret": 37})
    low, high, guesses = 1, 100, 0
    while True:
        guess = (low + high) // 2
        step, guesses = env.step(f"My guess: {guess}"), guesses + 1
        if step.done:
            break
        assert step.observation == ("higher" if guess < 37 else "lower")
        low, high = (guess + 1, high) if step.observation == "higher" else (low, guess - 1)
    assert guess == 37 and step.reward == 0.5 ** (guesses - 1)
    assert env.step("no number").info["invalid"] == 1.0
    a, b = envs.get("guess_number"), envs.get("guess_number")
    assert a.reset({"q": "x"}) == b.reset({"q": "x"}) and a.secret == b.secret  # from the row


def test_env_pool_steps_in_workers_with_state_between_calls():
    with envs.EnvPool(f"{TEST_ENVS}:Scripted", {"turns": 3}, workers=2) as pool:
        trajs, observations = pool.reset([{"question": "1+1="}, {"question": "2+2="}])
        assert observations == ["1+1=", "2+2="]
        trajs, _ = envs.replicate(trajs, observations, 2)
        assert pool.step(trajs, {i: "a" for i in range(4)}) == {i: "12" for i in range(4)}
        assert pool.step(trajs, {0: "bb", 1: "b"}) == {0: "3+4=", 1: "3+4="}
        assert pool.step(trajs, {0: "ccc"}) == {}
    assert [t.turns for t in trajs] == [3, 2, 1, 1] and trajs[0].end == "done"
    assert trajs[0].info == {"chars": 6.0} and trajs[0].rewards == [0.5, 0.5, 1.0]
    assert trajs[0].reward(0.0) == 1.0 and trajs[0].reward(0.5) == 1.0 + 0.25 * 0.5 + 0.5 * 0.5
    assert trajs[1].live and trajs[1].reward(0.0) == 0.5  # the last reward so far


def test_env_pool_lanes_run_steps_at_once(tmp_path):
    """With two lanes of one worker each, two callers' steps run at the same time, and so
    do the two halves of one batch (each step waits for the other's mark: "met")."""
    rows = [
        {"dir": str(tmp_path / "calls"), "me": "a", "other": "b"},
        {"dir": str(tmp_path / "calls"), "me": "b", "other": "a"},
        {"dir": str(tmp_path / "batch"), "me": "a", "other": "b"},
        {"dir": str(tmp_path / "batch"), "me": "b", "other": "a"},
    ]
    for d in ("calls", "batch"):
        (tmp_path / d).mkdir()
    with envs.EnvPool(f"{TEST_ENVS}:Meet", workers=2, lanes=2) as pool:
        trajs, _ = pool.reset(rows)
        with ThreadPoolExecutor(2) as callers:
            got = list(callers.map(lambda i: pool.step(trajs, {i: "x"}), (0, 1)))
        assert got == [{0: "met"}, {1: "met"}]
        assert pool.step(trajs, {2: "x", 3: "x"}) == {2: "met", 3: "met"}
        assert pool.restarts == 0
    with pytest.raises(ValueError, match="lanes=3: must be between 1 and workers=2"):
        envs.EnvPool(f"{TEST_ENVS}:Meet", workers=2, lanes=3)


def test_failing_environments_cost_their_trajectory_only():
    """An exception, a hang (killed at the step limit), a CPU spin, a crash, answers the
    trainer cannot use, a failed reset and a trajectory past its time limit each end
    their own trajectory with reward 0 and a reason; the well-behaved ones score."""
    modes = [
        "ok",
        "raises",
        "hangs",
        "spins",
        "crashes",
        "bad_reward",
        "bad_info",
        "not_a_step",
        "reset_raises",
        "slow",
        "ok",
    ]
    with envs.EnvPool(
        f"{TEST_ENVS}:Hostile", workers=2, step_timeout_s=1.5, trajectory_timeout_s=1.0
    ) as pool:
        trajs, _ = pool.reset([{"mode": m} for m in modes])
        pool.step(trajs, {i: "x" for i in range(len(modes))})
        pool.step(trajs, {i: "x" for i in range(len(modes))})
    ends = {m: (t.end, t.reward(1.0)) for m, t in zip(modes, trajs, strict=True)}
    assert ends == {
        "ok": ("done", 1.0),
        "raises": ("error", 0.0),
        "hangs": ("timeout", 0.0),
        "spins": ("timeout", 0.0),
        "crashes": ("error", 0.0),
        "bad_reward": ("error", 0.0),
        "bad_info": ("error", 0.0),
        "not_a_step": ("error", 0.0),
        "reset_raises": ("error", 0.0),
        "slow": ("timeout", 0.0),
    }
    assert "ValueError: boom" in trajs[1].error and "worker died" in trajs[4].error
    assert all(t.state is None for t in trajs)


def test_max_turns_schedule():
    assert schedule.turns_at(3, 100) == 3
    s = "2@0,4@100,8@300"
    assert [schedule.turns_at(s, k) for k in (0, 99, 100, 299, 300, 10**6)] == [2, 2, 4, 4, 8, 8]
    for bad, why in [
        ("2@5", "start at 0"),
        ("2@0,4@0", "increase"),
        ("x@0", "not 'turns@step'"),
        ("0@0", "turns must be >= 1"),
        ("", "expected a number"),
    ]:
        with pytest.raises(ValueError, match=why):
            schedule.parse(bad)


def _tokenizer(chat_template=None):
    from jaxrl_llm.models import builtin

    tok = builtin.load_tokenizer(TOKENIZER)
    tok.chat_template = chat_template
    return tok


# A tiny chat template in ChatML's shape, spelled in the arithmetic tokenizer's characters:
# "W" opens a message, "#" ends one ("#" is also the end-of-turn token the model stops on).
CHAT = (
    "{% for m in messages %}W{{ 'h' if m['role'] == 'user' else ('t' if m['role'] == 'tool' "
    "else 'a') }}\n{{ m['content'] }}#\n{% endfor %}{% if add_generation_prompt %}Wa\n{% endif %}"
)


def test_plain_observation_format():
    tok = _tokenizer()
    r = envs.Renderer(tok, use_chat=False)
    assert r.turn("42") == tok("\n42\n", add_special_tokens=False)["input_ids"]
    assert r.prompt("1+2=") == tok("1+2=")["input_ids"]


def test_chat_observation_is_the_templates_new_turn_only():
    """The turn is what the template adds for the observation: with the model's own
    end-of-turn token already sampled it is not repeated; after a turn cut by its budget
    the template's closing comes first. The tool role is used where the template has it."""
    tok = _tokenizer(CHAT)
    r = envs.Renderer(tok, use_chat=True)
    assert r.role == "tool"
    eot = tok.convert_tokens_to_ids("#")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert r.turn("42", closed_by=eot) == ids("\nWt\n42#\nWa\n")
    assert r.turn("42") == ids("#\nWt\n42#\nWa\n")
    assert r.prompt("1+2=") == ids("Wh\n1+2=#\nWa\n")
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"},
            {"role": "tool", "content": "42"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert r.prompt("1+2=") + ids("3#") + r.turn("42", closed_by=eot) == ids(whole)
    assert envs.Renderer(_tokenizer(CHAT.replace("tool", "tooo")), True).role == "user"


def test_turns_of_one_shape_are_each_the_templates_text():
    """A turn whose messages have the shape of an earlier one (roles, fields, closing
    token) reuses its layout; its ids are still the template's text for its own
    contents, tokenized, whichever order the shapes come in."""
    tok = _tokenizer(CHAT)
    r = envs.Renderer(tok, use_chat=True)
    eot = tok.convert_tokens_to_ids("#")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for text in ["42", "7", "1+2=", "42", ""]:
        assert r.turn(text, closed_by=eot) == ids(f"\nWt\n{text}#\nWa\n")
        assert r.turn(text) == ids(f"#\nWt\n{text}#\nWa\n")
        two = [{"role": "user", "content": text}, {"role": "tool", "content": "9"}]
        assert r.turn(two, closed_by=eot) == ids(f"\nWh\n{text}#\nWt\n9#\nWa\n")
    tok.chat_template = CHAT.replace("Wa", "Wb")  # a new template: no layout of the old one
    assert r.turn("42", closed_by=eot) == ids("\nWt\n42#\nWb\n")


def test_python_tool_runs_code_and_scores_the_final_answer():
    env = PythonTool(wall_s=3.0)
    env.reset({"answer": "708"})
    step = env.step("Compute.\n```python\nx = 12 * 59\nprint(x)\nprint('a\\nb')\n```")
    assert step.observation == "708\na\nb\n" and step.info == {
        "tool_calls": 1.0,
        "tool_errors": 0.0,
    }
    step = env.step("```python\nprint('before')\n1 / 0\n```")
    assert (
        step.observation.startswith("before\nTraceback") and "ZeroDivisionError" in step.observation
    )
    assert step.info["tool_errors"] == 1.0
    assert env.step("```python\nprint('x' * 5000)\n```").observation == "x" * 512
    assert env.step("```python\nimport sys; sys.exit(3)\n```").observation.endswith(
        "SystemExit: 3\n"
    )
    final = env.step("So 708.\n#### 708")
    assert final.done and final.reward == 1.0


HOSTILE = {
    "loop": "while True:\n    pass",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "memory_hog": "x = bytearray(4 << 30)\nprint(len(x))",
    "socket": "import socket\nsocket.create_connection(('8.8.8.8', 53), 1)\nprint('connected')",
    "read_outside": "print(open('/etc/shadow').read()[:20])",
}


def test_python_tool_survives_hostile_snippets():
    """The code verifier's hostile snippets, as tool calls in the pool: each answers an
    error observation, the trajectory goes on, no worker is lost to them."""
    names = list(HOSTILE)
    with envs.EnvPool(
        "python_tool", {"wall_s": 3.0, "cpu_s": 1}, workers=2, step_timeout_s=8.0
    ) as pool:
        trajs, _ = pool.reset([{"answer": "1"}] * len(names))
        obs = pool.step(trajs, {i: f"```python\n{HOSTILE[n]}\n```" for i, n in enumerate(names)})
        assert pool.restarts == 0
    assert sorted(obs) == list(range(len(names))) and all(t.live for t in trajs)
    got = dict(zip(names, (obs[i] for i in range(len(names))), strict=True))
    assert got["loop"].startswith("error:")  # the CPU limit
    assert "BlockingIOError" in got["fork_bomb"] or got["fork_bomb"].startswith("error:")
    assert "MemoryError" in got["memory_hog"] or got["memory_hog"].startswith("error")
    assert "connected" not in got["socket"] and "Error" in got["socket"]
    assert "Error" in got["read_outside"]  # PermissionError as nobody, or no such file


def test_env_config_is_checked_up_front():
    def config(**env):
        c = config_lib.base_config()
        c.model.path = "quickstart"
        c.data.max_prompt_len = 32
        c.env.max_total_tokens = 128
        c.rewards = {}
        c.env.name = "calculator"
        for k, v in env.items():
            c.env[k] = v
        return c

    config_lib.validate(config(max_turns="2@0,4@10"), num_devices=1)
    cases = [
        (dict(name="nope"), "env.name: unknown environment 'nope'"),
        (dict(options={"verifer": "gsm8k"}), "has no option 'verifer'"),
        (dict(max_turns="2@3"), "env.max_turns='2@3': the steps must start at 0"),
        (dict(max_total_tokens=8), "env.max_total_tokens=8 is below one turn"),
        (
            dict(workers=2, lanes=3),
            r"env.lanes=3: must be an integer between 1 and env.workers \(2\)",
        ),
    ]
    for env, message in cases:
        with pytest.raises(config_lib.ConfigError, match=message):
            config_lib.validate(config(**env), num_devices=1)
    c = config()
    c.rewards = {"gsm8k": 1.0}
    with pytest.raises(config_lib.ConfigError, match="rewards: with env.name set"):
        config_lib.validate(c, num_devices=1)
    c = config()
    c.env.max_turn = 3
    with pytest.raises(config_lib.ConfigError, match="env.max_turn: unknown key; did you mean"):
        config_lib.validate(c, num_devices=1)
