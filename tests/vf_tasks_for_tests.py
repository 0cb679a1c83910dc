"""A `verifiers` (0.4.0) environment the gateway tests run as
`agent.entry=verifiers:vf_tasks_for_tests`, written with verifiers' own classes only: a
taskset of arithmetic questions, a task whose rubric (`@vf.reward`) scores the last reply
(its length: a reward that varies for a random model), and a two-turn env (the model
answers, the env says "7", the model answers again)."""

import verifiers.v1 as vf

QUESTIONS = ["1+2=", "12*3=", "7-4=", "2+2="]
FAILING = "fail="  # the env raises on this task (the fifth, with the option `failing`)


class QuestionData(vf.TaskData):
    question: str


class QuestionTask(vf.Task[QuestionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digit(self, task, trace) -> float:
        """The last reply's length in characters, surrounding spaces aside."""
        return reply_reward(trace.last_reply)


def reply_reward(text: str) -> float:
    return float(len(text.strip()))  # verifiers strips the replies it reports


class QuestionsConfig(vf.TasksetConfig):
    repeat: int = 1  # a taskset option (agent.options.repeat)
    failing: bool = False  # adds the task FAILING


class Questions(vf.Taskset[QuestionTask, QuestionsConfig]):
    def load(self):
        for _ in range(self.config.repeat):
            for q in [*QUESTIONS, FAILING] if self.config.failing else QUESTIONS:
                yield QuestionTask(QuestionData(prompt=q, question=q), self.config.task)


class TwoTurnsConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class TwoTurns(vf.Env[TwoTurnsConfig]):
    """The model answers; the env answers "7"; the model answers again. The env adds
    its own reward ("first": the first reply's length, weight 0.5) to the task's."""

    async def run(self, task, agents):
        if task.data.question == FAILING:
            raise RuntimeError("the env gave up")
        async with agents.player.interaction(task) as interaction:
            first = await interaction.turn()
            second = await interaction.turn("7")
        interaction.trace.record_reward("first", reply_reward(first.last_reply), 0.5)
        interaction.trace.info["replies"] = [first.last_reply, second.last_reply]


__all__ = ["Questions", "TwoTurns"]
