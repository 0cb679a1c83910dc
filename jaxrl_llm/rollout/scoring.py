"""One step's rollouts on the host: completion ids -> text -> verifier pool -> rewards.

    scorer = Scorer(tokenizer, pool, specs, spec, overlong_buffer=..., mesh=mesh)
    scored = scorer(out, batch)        # this process's rows of a sampling.SampleOutput

The only device->host transfer of a step is the completion ids (with their lengths and
finish reasons); the rewards go back to the device in the update's batch. DAPO's dynamic
sampling keeps the groups whose G rewards differ (`rl.degenerate_groups`): the trainer
samples and scores more batches, and `merge_mixed_groups` builds the step's batch from
the first B mixed groups of all of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import parallel, rl, sampling, verifiers
from jaxrl_llm.verifiers.judge import is_judge


@dataclasses.dataclass
class Scored:
    """This process's rows of one rollout (n = its share of B * G, prompt-major), scored."""

    rewards: np.ndarray  # [n] float32: weighted verifier sum, overlong penalty added
    metrics: dict  # reward/<label>, verifier/*, rollout/* (host floats)
    completions: list[str]
    prompts: list[str]
    examples: list[dict]
    lengths: np.ndarray  # [n] completion tokens
    prompt_lengths: np.ndarray  # [n] real (unpadded) prompt tokens
    details: verifiers.ScoreDetails | None = None  # errors, timeouts, first error
    turns: list | None = None  # multi-turn: per row [{"role": "model" | "env", "text"}]


class Scorer:
    """Decodes a `sampling.SampleOutput` and scores it with the verifier pool.

    Args:
      tokenizer: decodes completion ids (special tokens skipped).
      pool: a `verifiers.VerifierPool`.
      specs: the reward terms (`verifiers.parse_specs`).
      spec: the rollout spec (G; max_new_tokens = DAPO's L_max).
      overlong_buffer: DAPO's L_c in tokens; 0 = no overlong penalty (`rl.overlong_penalty`).
      mesh: the device mesh (each process reads and scores its own rows).
      judges: the `judges.Judge` of each judge entry of `specs` (run on the mesh; the
        other entries go to the pool).
    """

    def __init__(
        self,
        tokenizer,
        pool,
        specs,
        spec: sampling.RolloutSpec,
        *,
        overlong_buffer: int = 0,
        mesh=None,
        judges=(),
    ):
        self.tokenizer, self.pool, self.specs, self.spec = tokenizer, pool, specs, spec
        self.overlong_buffer, self.mesh = overlong_buffer, mesh
        self.judges = list(judges)
        self.pool_specs = [s for s in specs if not is_judge(s)]
        self.calls = 0  # scoring calls done (a judge samples once in each)

    def decode(self, out: sampling.SampleOutput):
        """This process's completion ids -> (texts, lengths, finish); the one device->host
        transfer of a step."""
        rows = parallel.local_rows((out.tokens, out.lengths, out.finish), self.mesh)
        tokens, lengths, finish = (np.asarray(x) for x in rows)
        texts = self.tokenizer.batch_decode(
            [row[:n] for row, n in zip(tokens, lengths, strict=True)], skip_special_tokens=True
        )
        return texts, lengths, finish

    def __call__(self, out: sampling.SampleOutput, batch) -> Scored:
        """Scores this process's rows of `out`, sampled from the prompts of `batch` (a
        `data.PromptBatch`)."""
        G = out.num_generations
        texts, lengths, finish = self.decode(out)
        examples = [ex for ex in batch.examples for _ in range(G)]
        prompts = [p for p in batch.prompts for _ in range(G)]
        rewards, details = self._score(texts, examples, prompts, lengths)
        metrics = details.metrics()
        if self.overlong_buffer:
            penalty = rl.overlong_penalty(lengths, self.spec.max_new_tokens, self.overlong_buffer)
            rewards = rewards + penalty
            metrics["reward/overlong"] = float(penalty.mean())
        metrics |= {
            "rollout/length_mean": float(lengths.mean()),
            "rollout/length_max": float(lengths.max()),
            "rollout/truncated_frac": float(np.mean(finish == sampling.FINISH_LENGTH)),
        }
        return Scored(
            rewards=np.asarray(rewards, np.float32),
            metrics=metrics,
            completions=texts,
            prompts=prompts,
            examples=examples,
            lengths=lengths,
            prompt_lengths=np.repeat(np.asarray(batch.prompt_mask).sum(axis=1), G),
            details=details,
        )

    def _score(self, texts, examples, prompts, lengths):
        """The pool's entries, then each judge's (one batched sampler call each): the
        weighted sum [n] and the merged `verifiers.ScoreDetails`."""
        if self.pool_specs:
            rewards, details = self.pool.score(
                self.pool_specs, texts, examples, num_tokens=lengths.tolist()
            )
        else:
            rewards = np.zeros(len(texts))
            details = verifiers.ScoreDetails(
                per_verifier={},
                weights={},
                errors={},
                timeouts={},
                messages=[],
                num_samples=len(texts),
            )
        for judge in self.judges:
            scores, errors = judge(texts, examples, prompts, step=self.calls + 1)
            label = judge.label
            weight = next(s.weight for s in self.specs if s.label == label)
            rewards = rewards + weight * scores
            details.per_verifier[label] = scores
            details.weights[label] = weight
            details.errors[label] = details.failed[label] = len(errors)
            details.timeouts[label] = 0
            if errors:
                first = f"{label} sample {errors[0][0]}: {errors[0][1]}"
                details.first_error = details.first_error or first
                details.messages.extend(f"{label} sample {i}: {m}" for i, m in errors[:3])
        self.calls += 1
        return rewards, details


def mixed_groups(scored: Scored, num_generations: int) -> int:
    """How many of this process's groups have rewards that differ (carry a gradient)."""
    return int((~rl.degenerate_groups(scored.rewards, num_generations)).sum())


def merge_mixed_groups(parts, num_generations: int, num_groups: int, mesh=None):
    """[(SampleOutput, Scored), ...] -> one (SampleOutput, Scored) of `num_groups` groups
    per process: the first mixed-reward groups over all parts, then degenerate ones if
    too few (their advantage is 0: they add nothing, and keep the shapes static)."""
    G = num_generations
    rewards = np.concatenate([s.rewards for _, s in parts])
    mixed = ~rl.degenerate_groups(rewards, G)
    groups = np.concatenate([np.nonzero(mixed)[0], np.nonzero(~mixed)[0]])[:num_groups]
    rows = (groups[:, None] * G + np.arange(G)).reshape(-1)
    outs = [o for o, _ in parts]
    index = jax.device_put(
        _global_rows(rows, parts, mesh),
        outs[0].tokens.sharding if mesh is None else NamedSharding(mesh, PartitionSpec()),
    )
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    flat = lambda name: [x for _, s in parts for x in getattr(s, name)]  # noqa: E731
    first = parts[0][1].metrics
    metrics = {k: float(np.mean([s.metrics[k] for _, s in parts if k in s.metrics])) for k in first}
    scored = Scored(
        rewards=rewards[rows],
        metrics=metrics,
        completions=pick(flat("completions")),
        prompts=pick(flat("prompts")),
        examples=pick(flat("examples")),
        lengths=np.concatenate([s.lengths for _, s in parts])[rows],
        prompt_lengths=np.concatenate([s.prompt_lengths for _, s in parts])[rows],
        details=parts[0][1].details,  # the step's first batch: every row of it scored
    )
    rows_on = None if mesh is None else NamedSharding(mesh, PartitionSpec(parallel.BATCH_AXES))
    return _select_rows(outs, index, rows_on), scored


@functools.partial(jax.jit, static_argnums=2)
def _select_rows(outs: list[sampling.SampleOutput], index: jax.Array, rows_on=None):
    """Concatenates SampleOutputs (left-padding shorter prompt buckets, padding masked)
    and keeps the rows in `index`; jitted, so no constant is transferred implicitly.
    rows_on: the rows' sharding (the sampler's), so that the reference and the update
    compiled for a rollout of these shapes serve the merged one (None: XLA's choice)."""
    P = max(o.prompt_tokens.shape[1] for o in outs)
    T = max(o.tokens.shape[1] for o in outs)

    def widen(x, left):  # 0 / False: masked padding
        pad = (P - x.shape[1], 0) if left else (0, T - x.shape[1])
        return jnp.pad(x, ((0, 0), pad))

    outs = [
        o.replace(
            prompt_tokens=widen(o.prompt_tokens, True),
            prompt_mask=widen(o.prompt_mask, True),
            **{f: widen(getattr(o, f), False) for f in ("tokens", "mask", "loss_mask", "logprobs")},
            routes=sampling.fit_routes(o.routes, o.prompt_tokens.shape[1], P, T),
        )
        for o in outs
    ]
    merged = jax.tree.map(lambda *xs: jnp.concatenate(xs)[index], *outs)
    if rows_on is None:
        return merged
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows_on), merged)


def _global_rows(rows: np.ndarray, parts, mesh) -> np.ndarray:
    """This process's selected rows (indices into its parts, concatenated) -> indices into
    the concatenation of the global outputs, gathered from every process in order."""
    if mesh is None or jax.process_count() == 1:
        return rows
    from jax.experimental import multihost_utils

    n_local, n_global = len(parts[0][1].rewards), parts[0][0].tokens.shape[0]
    table = np.asarray(multihost_utils.process_allgather(rows))  # [processes, selected]
    part, i = np.divmod(table, n_local)
    offset = np.arange(table.shape[0])[:, None] * n_local
    return (part * n_global + offset + i).reshape(-1)
