"""`env.max_turns` as a number or a schedule over training steps.

    turns_at("4", 10) == 4
    turns_at("2@0,4@100,8@300", 150) == 4     # value@from_step, steps ascending

Growing the allowed turns over training (ScalingInter-RL) starts the policy on short
interactions and lets it use more once it acts well in few.
"""

from __future__ import annotations


def parse(schedule) -> list[tuple[int, int]]:
    """[(from_step, turns)], ascending; ValueError naming what is wrong."""
    if isinstance(schedule, int) and not isinstance(schedule, bool):
        schedule = str(schedule)
    if not isinstance(schedule, str) or not schedule.strip():
        raise ValueError(f"env.max_turns={schedule!r}: expected a number or 'turns@step,...'")
    points = []
    for part in schedule.split(","):
        value, _, start = part.strip().partition("@")
        try:
            point = (int(start or 0), int(value))
        except ValueError:
            raise ValueError(
                f"env.max_turns={schedule!r}: {part.strip()!r} is not 'turns@step'"
            ) from None
        if point[1] < 1 or point[0] < 0:
            raise ValueError(f"env.max_turns={schedule!r}: turns must be >= 1, steps >= 0")
        points.append(point)
    starts = [s for s, _ in points]
    if starts[0] != 0 or starts != sorted(set(starts)):
        raise ValueError(f"env.max_turns={schedule!r}: the steps must start at 0 and increase")
    return points


def turns_at(schedule, step: int) -> int:
    """The number of turns allowed at training step `step`."""
    return [turns for start, turns in parse(schedule) if start <= step][-1]


def most(schedule) -> int:
    return max(turns for _, turns in parse(schedule))
