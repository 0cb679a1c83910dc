"""`python_tool`: the model runs Python and reads its output; a turn without code is its
final answer, scored by a verifier.

    step("Let me compute.\n```python\nprint(12 * 59)\n```") -> Step("708\n")
    step("So the answer is 708.\n#### 708") -> Step(reward=gsm8k(answer, example), done=True)

The last fenced ```` ```python ```` block of a turn runs in the code verifier's sandbox
(`verifiers.run_python`: a fresh interpreter, CPU / memory / process / file limits, and
as root namespaces, no network, an unprivileged user). What it printed to stdout and
stderr (an exception's last traceback line included) comes back, cut to
`max_output_chars`; a run that passes a limit answers `error: ...`. Each block runs on
its own: variables do not carry over between turns.
"""

from __future__ import annotations

import ast
import re

from jaxrl_llm import verifiers
from jaxrl_llm.envs.base import Env, Step

CODE = re.compile(r"```python\s*\n(.*?)```", re.DOTALL)
_SETUP = "import io, sys, traceback\n_out = io.StringIO()\nsys.stdout = sys.stderr = _out\n"
# Runs the model's code with its output captured, then hands the output back as the
# message of a failing "test" (the only text that leaves the sandbox), cut so that its
# repr fits the sandbox's report line.
_WRAP = (
    "try:\n    exec(compile({code!r}, '<cell>', 'exec'), {{'__name__': '__main__'}})\n"
    "except BaseException:\n    traceback.print_exc(limit=-1)\n"
)
_REPORT = (
    "_s = _out.getvalue()[:{limit}]\n"
    "while len(repr(_s)) > 1800:\n    _s = _s[: len(_s) // 2]\n"
    "raise AssertionError(repr(_s))"
)


class PythonTool(Env):
    """Options: verifier, answer_key (final answer), max_output_chars, cpu_s, wall_s,
    memory_mb (the sandbox's limits; keep wall_s below `env.step_timeout_s`)."""

    def __init__(
        self,
        verifier: str = "gsm8k",
        answer_key: str = "answer",
        max_output_chars: int = 512,
        cpu_s: int = 2,
        wall_s: float = 4.0,
        memory_mb: int = 512,
    ):
        self.verifier, self.answer_key = verifier, answer_key
        self.max_output_chars = min(int(max_output_chars), 1000)
        self.limits = verifiers.Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
        self.example: dict = {}

    def reset(self, example):
        self.example = dict(example)
        return None

    def step(self, action: str) -> Step:
        blocks = CODE.findall(action)
        if not blocks:
            score = verifiers.get(self.verifier, answer_key=self.answer_key)(action, self.example)
            return Step(reward=float(score), done=True, info={"correct": float(score > 0.5)})
        output, failed = self.run(blocks[-1])
        return Step(observation=output, info={"tool_calls": 1.0, "tool_errors": float(failed)})

    def run(self, code: str) -> tuple[str, bool]:
        """(what the code printed, or why it stopped; whether it failed)."""
        result = verifiers.run_python(
            _WRAP.format(code=code),
            [_REPORT.format(limit=self.max_output_chars)],
            setup=_SETUP,
            limits=self.limits,
        )
        prefix = "AssertionError: "
        if result.status == "failed" and result.message.startswith(prefix):
            output = ast.literal_eval(result.message[len(prefix) :])
            return output or "(no output)", "Traceback" in output or "Error" in output
        if result.status == "timeout":
            return f"error: time limit ({self.limits.wall_s:g} s)", True
        return f"error: {result.message or result.status}"[: self.max_output_chars], True
