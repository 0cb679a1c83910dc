"""Environment hubs with the real PyPI packages: reasoning-gym tasks as a data source
with their own scorers, TextArena single-player games as environments. Each against the
package itself, two training steps each, and bad names as one line."""

import json

import ml_collections
import numpy as np
import pytest
from tiny_run import TOKENIZER, make_model_dir, tiny_config, tiny_model_config

from jaxrl_llm import envs, models, train
from jaxrl_llm.config import ConfigError, validate
from jaxrl_llm.data import reasoning_gym as rg_source
from jaxrl_llm.trainer import metrics

rg = pytest.importorskip("reasoning_gym")
ta = pytest.importorskip("textarena")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_model")))


def small(c):
    """2 steps of 4 prompts x 2, short turns, no reference: cheap programs."""
    c.rollout.batch_size, c.rollout.num_generations, c.rollout.max_new_tokens = 4, 2, 4
    c.rollout.cache_segments, c.model.scan_layers, c.algo.beta = 1, True, 0.0
    c.train.log_every = 1
    return c


def test_reasoning_gym_rows_and_scores_are_the_packages():
    """Row i of a split is the package's generator at (split seed, i); the score is the
    task's own scorer on the text inside <answer> tags."""
    source = rg_source.ReasoningGymSource("reasoning_gym/basic_arithmetic", "train")
    reference = rg.create_dataset("basic_arithmetic", size=rg_source.ROWS, seed=1)
    for i in (0, 7, 99_999):
        row, entry = source[i], reference[i]
        assert row["question"] == entry["question"] and row["answer"] == str(entry["answer"])
        assert rg_source.score(f"so <answer>{entry['answer']}</answer>", row) == 1.0
        assert rg_source.score("<answer>nope</answer>", row) == reference.score_answer(
            answer="nope", entry=entry
        )
    test = rg_source.ReasoningGymSource("reasoning_gym/basic_arithmetic", "test")
    assert [test[i]["question"] for i in range(5)] != [source[i]["question"] for i in range(5)]
    # data.options: the task's own settings, as the package applies them.
    easy = rg_source.ReasoningGymSource("reasoning_gym/chain_sum", "train", {"max_terms": 2})
    reference = rg.create_dataset("chain_sum", size=rg_source.ROWS, seed=1, max_terms=2)
    assert [easy[i]["question"] for i in range(20)] == [reference[i]["question"] for i in range(20)]
    assert all(json.loads(easy[i]["metadata"])["num_terms"] == 2 for i in range(20))


def test_reasoning_gym_task_trains_two_steps(model_dir, tmp_path):
    c = small(tiny_config(model_dir))
    c.data.name, c.data.max_prompt_len = "reasoning_gym/basic_arithmetic", 48
    c.data.template = "{question}"  # short prompts (the default asks for <answer> tags)
    c.data.skip_bad_rows = True
    c.rewards = {"reasoning_gym": 1.0}
    train.train(c, str(tmp_path / "run"))
    rows = [r for r in metrics.read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert len(rows) == 2 and all(np.isfinite(r["loss/total"]) for r in rows)
    assert all("reward/reasoning_gym" in r for r in rows)


def test_textarena_game_plays_like_the_package():
    """Through the pool (worker processes, state pickled between calls), a game's
    observations and final reward equal the package's own base game played with the same
    seed and moves."""
    moves = [f"I guess [{g}]" for g in (10, 5, 15, 3, 17, 8, 12, 1, 20, 2)]
    with envs.EnvPool("textarena/GuessTheNumber-v0", workers=1) as pool:
        trajs, observations = pool.reset([{"seed": 11}])
        got, reward = [observations[0]], None
        for move in moves:
            obs = pool.step(trajs, {0: move})
            if not trajs[0].live:
                reward = trajs[0].rewards[-1]
                break
            got.append(obs[0])
    game = ta.make("GuessTheNumber-v0")
    while isinstance(game, ta.core.Wrapper):
        game = game.env
    game.reset(num_players=1, seed=11)
    expected = [game.get_observation()[1][0][1].strip()]
    for move in moves:
        done, _ = game.step(move)
        if done:
            assert reward == float(game.close()[0][0])
            break
        expected.append(game.get_observation()[1][-1][1].strip())
    assert got == expected and reward is not None


@pytest.mark.slow
def test_textarena_game_trains_two_steps(tmp_path):
    """The game's opening text is ~450 characters: a tiny model with a longer context."""
    cfg = tiny_model_config(vocab_size=33, tie_word_embeddings=True, max_position_embeddings=1024)
    models.save_hf(
        cfg, models.init_params(cfg, seed=0), str(tmp_path / "m"), tokenizer_dir=TOKENIZER
    )
    c = small(tiny_config(str(tmp_path / "m")))
    c.rewards, c.data.max_prompt_len = {}, 512
    c.env.name, c.env.max_turns, c.env.max_total_tokens = "textarena/GuessTheNumber-v0", 2, 64
    c.env.workers = 1
    train.train(c, str(tmp_path / "run"))
    rows = [r for r in metrics.read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in r]
    assert len(rows) == 2 and all(np.isfinite(r["loss/total"]) for r in rows)
    assert all(r["env/errors"] == 0 and r["env/turns_mean"] >= 1 for r in rows)


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("data", "name", "reasoning_gym/basic_arithmatic", "did you mean basic_arithmetic"),
        ("data", "split", "validation", "data.split='validation'"),
        ("data", "options", {"max_term": 2}, "data.options.max_term: not a setting"),
        ("data", "options", {"max_terms": 1}, "refuses them: AssertionError"),
        ("env", "name", "textarena/GuessTheNumbr-v0", "did you mean GuessTheNumber-v0"),
    ],
)
def test_bad_hub_names_are_one_line(model_dir, section, key, value, message):
    c = tiny_config(model_dir)
    if section == "data":
        c.data.name = "reasoning_gym/basic_arithmetic"
    else:
        c.rewards = {}
    c[section][key] = value if key != "options" else ml_collections.ConfigDict(value)
    with pytest.raises(ConfigError) as err:
        validate(c, 8)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_chain_sum_agent_example_scores_with_reasoning_gym():
    """examples/chain_sum_agent.py (configs/agent_chain_sum_smollm2.py's agent) imports
    nothing of jaxrl_llm, scores the reply's last number with reasoning-gym's scorer and
    retries once after a wrong answer, with the conversation extended (not rewritten)."""
    import asyncio
    import importlib.util
    import os
    import types

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "chain_sum_agent.py")
    with open(path) as f:
        assert "jaxrl_llm" not in f.read().split('"""', 2)[-1]
    spec = importlib.util.spec_from_file_location("chain_sum_agent", path)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    example = rg_source.ReasoningGymSource(
        "reasoning_gym/chain_sum", "test", {"max_terms": 2, "max_digits": 2}
    )[0]
    right, wrong = example["answer"], str(int(example["answer"]) + 1)

    class Client:  # the part of openai.AsyncOpenAI the agent uses
        def __init__(self, replies):
            self.replies, self.seen = list(replies), []
            self.chat = types.SimpleNamespace(completions=self)

        async def create(self, model, messages):
            self.seen.append([dict(m) for m in messages])
            message = types.SimpleNamespace(content=self.replies.pop(0))
            return types.SimpleNamespace(choices=[types.SimpleNamespace(message=message)])

    for replies, reward in [([f"x = {right}"], 1.0), ([wrong, right], 0.5), ([wrong, "no"], 0.0)]:
        client = Client(replies)
        assert asyncio.run(agent.run(client, example)) == reward
        if len(client.seen) == 2:  # the second request extends the first
            first, second = client.seen
            assert second[: len(first)] == first
            assert second[len(first)] == {"role": "assistant", "content": wrong}


def test_a_textarena_game_that_does_not_load_is_refused_up_front(monkeypatch):
    """A game TextArena lists but cannot make in this Python (TextArena 0.7.4's Chess-v0
    on Python 3.11: a SyntaxError in its module) is one line naming env.name before the
    start, instead of a failed reset per trajectory."""
    textarena = pytest.importorskip("textarena")
    from jaxrl_llm.envs import textarena_games

    def broken(game, **kwargs):
        raise SyntaxError("f-string: unmatched '['")

    monkeypatch.setattr(textarena, "make", broken)
    with pytest.raises(ValueError) as err:
        textarena_games.check_game("GuessTheNumber-v0")
    assert str(err.value) == (
        "env.name='textarena/GuessTheNumber-v0': TextArena cannot make this game here "
        "(SyntaxError: f-string: unmatched '['); choose another game"
    )
