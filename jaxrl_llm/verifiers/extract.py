"""Answer extraction shared by the verifiers: `####` answers, `\\boxed{}`, tags, code blocks.

Every function here is pure text processing: no imports beyond the standard library, so a
pool worker pays nothing for it.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}` in `text`, in order.

    Braces are matched by depth, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}` (a regex
    cannot do this). An unclosed box (a completion cut at max tokens) is ignored.
    """
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            char = text[pos]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:pos])
                    break
    return found


def hash_answers(text: str) -> list[str]:
    """The text after each GSM8K-style `####` marker, up to the end of its line."""
    return [segment.split("\n", 1)[0].strip() for segment in text.split("####")[1:]]


def tagged(text: str, tag: str) -> str | None:
    """Content of the LAST `<tag>...</tag>` in `text`, stripped; None when there is none.

    The last one counts because models often restate the format in their reasoning before
    giving the real answer.
    """
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.DOTALL)
    return matches[-1].strip() if matches else None


def code_block(text: str, languages: tuple[str, ...] = ("python", "py", "")) -> str:
    """The last fenced code block whose language is in `languages`, else the whole text.

    A block left open at the end (generation stopped inside it) still counts: the code up
    to the cut is what the model wrote.
    """
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in languages]
    return blocks[-1] if blocks else text
