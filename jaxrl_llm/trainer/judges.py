"""Judge reward entries on the mesh: a model, its tokenizer and its own `Sampler`.

    judges = make_judges(specs, mesh, dtype="float32", seed=0,
                         prompt_budget=64 + 16)      # one per `judge` entry
    scores, errors = judges[0](completions, examples, prompts, step)

Each call renders the entry's template for every completion of this process
(`verifiers.judge.render`), samples every verdict in ONE batched sampler call (greedy by
default; `calls` counts them), decodes this process's rows and parses each verdict into a
number (`verifiers.judge.parse_verdict`). An unparsable verdict scores 0 and is returned
as an error `(row, message)`; `scoring.Scorer` counts it like a verifier's error.

The prompts are padded to one width (`width`: the entry's `prompt_len`, else the
template's tokens + the question's and the completion's budgets), not to each step's
longest prompt, so the judge's sampler is one program, which start-up compiles ahead of
the first step (`program`, `startup.precompile`). A step whose prompts are longer takes
its own bucket, compiled when it comes (its line printed).
"""

from __future__ import annotations

import contextlib

import numpy as np

from jaxrl_llm import config as config_lib
from jaxrl_llm import models, parallel, sampling
from jaxrl_llm.data import prompts as prompts_lib
from jaxrl_llm.verifiers import judge as judge_lib


class Judge:
    """One judge entry: its model, tokenizer and sampler on `mesh`.

    Args:
      spec: the entry (`verifiers.VerifierSpec` with name `judge`).
      mesh: the mesh it generates on (the training mesh).
      dtype: its params' dtype (model.dtype).
      seed: its sampler's seed (matters only with temperature > 0).
      prompt_budget: the question's and the completion's token budgets together
        (data.max_prompt_len + rollout.max_new_tokens): with the template's own tokens,
        the prompts' width when the entry sets no `prompt_len`.
      compile_log: the run's `startup.compilation.CompileLog` (None: compiles unnamed).
    """

    def __init__(
        self,
        spec,
        mesh,
        dtype: str = "float32",
        seed: int = 0,
        prompt_budget: int = 0,
        compile_log=None,
    ):
        o = self.options = dict(spec.options)
        self.label, self.mesh = spec.label, mesh
        key = f"rewards.{spec.label}.options.model"
        path = config_lib.resolve_model_path(o["model"], key)
        self.tokenizer = models.builtin.load_tokenizer(path, key)
        self.model_cfg, self.params = models.builtin.load_model(path, mesh, dtype)
        self.pad = prompts_lib.pad_id(self.tokenizer)
        self.sampler = sampling.Sampler(self.model_cfg, mesh, seed=seed, pad_id=self.pad)
        eos = self.tokenizer.eos_token_id
        self.spec = sampling.RolloutSpec(
            num_generations=1,
            max_new_tokens=int(o.get("max_new_tokens", 16)),
            temperature=float(o.get("temperature", 0.0)),
            stop_ids=() if eos is None else (int(eos),),
        )
        self.template = o.get("template", "{question}\n{completion}\n")
        self.parser = o.get("parser", "number")
        self.compile_log = compile_log
        self.name = f"{self.label} sampler"  # its program's name in the compile log
        width = int(o.get("prompt_len", 0))
        if not width:
            empty = self.template.format(completion="", question="", answer="")
            width = len(self.tokenizer(empty)["input_ids"]) + int(prompt_budget)
        self.width = sampling.bucket_length(width, self.sampler.bucket_steps)
        self.calls = 0  # batched sampler calls so far (one per scoring of a step)

    def program(self, rows: int):
        """The sampler's jitted program and its arguments for `rows` prompts at `width`:
        what start-up compiles ahead of the first call."""
        ids = np.full((rows, self.width), self.pad, np.int32)
        ids[:, -1] = 0 if self.pad else 1  # one real token a row: only the shapes matter
        mask = np.zeros((rows, self.width), bool)
        mask[:, -1] = True
        return self.sampler.sample_program(self.params, *self._place(ids, mask), self.spec)

    def _place(self, ids, mask):
        """This process's padded prompts -> the global batch on the mesh, at their width
        (placed arrays: the sampler keeps the width it is given)."""
        return parallel.shard_local_batch((ids, mask), self.mesh)

    def __call__(self, completions, examples, prompts, step: int = 0):
        """This process's completions -> (scores [n] float64, errors [(row, message)])."""
        texts = [
            judge_lib.render(self.template, c, ex, p, self.options)
            for c, ex, p in zip(completions, examples, prompts, strict=True)
        ]
        ids = [self.tokenizer(t)["input_ids"] for t in texts]
        longest = sampling.bucket_length(max(map(len, ids)), self.sampler.bucket_steps)
        width = max(self.width, parallel.host_max(longest))  # every host, one width
        limit = self.model_cfg.max_position_embeddings
        if width + self.spec.max_new_tokens > limit:
            raise ValueError(
                f"rewards.{self.label}: a judge prompt of {width} tokens (bucket) + "
                f"max_new_tokens={self.spec.max_new_tokens} exceeds the judge model's "
                f"max_position_embeddings {limit}; shorten rewards.{self.label}.options."
                "template or the prompts and completions it holds"
            )
        placed = self._place(*sampling.pad_prompts(ids, self.pad, bucket=width))
        compiling = (
            contextlib.nullcontext()
            if self.compile_log is None
            else self.compile_log.program(self.name, f"bucket {width}")
        )
        with compiling:
            out = self.sampler.sample(self.params, *placed, self.spec, step)
        self.calls += 1
        tokens, lengths = (
            np.asarray(x) for x in parallel.local_rows((out.tokens, out.lengths), self.mesh)
        )
        verdicts = self.tokenizer.batch_decode(
            [row[:n] for row, n in zip(tokens, lengths, strict=True)], skip_special_tokens=True
        )
        scores, errors = np.zeros(len(verdicts)), []
        for i, text in enumerate(verdicts):
            try:
                scores[i] = judge_lib.parse_verdict(text, self.parser)
            except ValueError as err:
                errors.append((i, str(err)))
        self.last_verdicts = verdicts
        return scores, errors


def make_judges(
    specs, mesh, dtype: str = "float32", seed: int = 0, prompt_budget: int = 0, compile_log=None
) -> list[Judge]:
    """A `Judge` for every judge entry of `specs`, in order (arguments as `Judge`'s)."""
    return [
        Judge(s, mesh, dtype, seed, prompt_budget, compile_log)
        for s in specs
        if judge_lib.is_judge(s)
    ]
