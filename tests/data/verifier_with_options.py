"""User verifiers for the tests, loaded as 'tests/data/verifier_with_options.py:function'."""


def below(completion: str, example: dict, limit: int, scale: float = 1.0) -> float:
    """scale when the completion is shorter than `limit` characters (a required option)."""
    return scale * float(len(completion) < limit)


def tokens_over(completion: str, example: dict, limit: int) -> float:
    """How many tokens the completion has beyond `limit` (the count the trainer passes)."""
    return float(max(0, int(example["num_tokens"]) - limit))


def needs_answer(completion: str, example: dict) -> float:
    """A reward that reads a field the rows may lack (KeyError then: a verifier error)."""
    return float(completion.strip() == str(example["answer"]))
