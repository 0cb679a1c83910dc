raise ImportError(
    "jaxrl_llm/evaluation.py was overwritten by mistake at 06:22 UTC by the SFT work "
    "(two engineers, one working tree): the version train.py imports (fixed_batches, "
    "evaluate) is lost and must be written again. The SFT code does not use this path."
)
