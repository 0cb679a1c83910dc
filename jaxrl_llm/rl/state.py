"""The train state the update step changes, and how a fresh one is made.

state = init_train_state(params, opt)                       # policy only
state = init_train_state(params, opt, critic_params, opt)   # PPO: + critic
state = init_train_state(adapters, opt, frozen=base)        # LoRA: only adapters train

With LoRA, `params` holds the trainable adapters and `frozen` the base weights: gradients,
optimizer moments and float32 master copies cover `params` only; `frozen` is read by the
update (and by the sampler and the reference) but never donated, changed or checkpointed
(`checkpointed`): the base is reloaded from `model.path` on resume.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.rl.optim import Optimizer


@struct.dataclass
class TrainState:
    """Everything the update changes. step counts update calls (trainer steps)."""

    step: jax.Array  # [] int32
    params: Any  # what trains: all weights, or the LoRA adapters
    opt_state: Any
    critic_params: Any = None  # PPO only
    critic_opt_state: Any = None
    frozen: Any = None  # LoRA: the base weights (never updated, donated or checkpointed)

    def policy_params(self):
        """The params the policy model reads: base + adapters with LoRA (no copy)."""
        from jaxrl_llm.models import lora

        return self.params if self.frozen is None else lora.combine(self.frozen, self.params)


def checkpointed(state: TrainState) -> TrainState:
    """What a checkpoint holds: the state without the frozen base."""
    return state.replace(frozen=None)


def _replicated(params):
    """Where the params live, whole: replicated on their mesh, or their device (None for
    host arrays)."""
    shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(params)]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    if mesh is not None:
        return NamedSharding(mesh, PartitionSpec())
    if shardings and shardings[0] is not None:
        return jax.sharding.SingleDeviceSharding(next(iter(shardings[0].device_set)))
    return None


def commit_like(tree, params):
    """Commits tree's leaves (optimizer counts, the step) where the params live: replicated
    on their mesh, or on their device. Uncommitted or differently placed inputs would make
    the second update call compile again."""
    target = _replicated(params)
    if target is None:
        return tree
    keep = lambda x: isinstance(x.sharding, NamedSharding)  # noqa: E731 (always committed)
    return jax.tree.map(lambda x: x if keep(x) else jax.device_put(x, target), tree)


_own = jax.jit(lambda x: x, donate_argnums=0)


def owned(tree):
    """`tree`'s arrays in buffers that a donating program can write its outputs over. On
    CPU, `jax.device_put` of a numpy array whose data is aligned (tcmalloc's large
    allocations are, the trainer's allocator: `parallel.allocator`) makes a view of the
    numpy memory, not a copy; a call donating such a buffer cannot reuse it and allocates
    its outputs beside it, so the first update after loading weights (or restoring a
    checkpoint) held a second copy of them (Gemma 3 270M: +640 MiB of peak). Each CPU
    leaf goes once through a donating identity program: a buffer XLA made is passed
    through as it is, a view is copied once into one it makes. One leaf at a time: the
    copies cost at most the largest leaf. Accelerator leaves (device memory already) are
    returned as they are. The arrays of `tree` must have no other holder (they are
    donated)."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_deleted():
            return x
        if any(d.platform != "cpu" for d in x.sharding.device_set):
            return x
        return jax.block_until_ready(_own(x))

    return jax.tree.map(one, tree)


def fresh_opt_state(opt: Optimizer, params):
    """`opt.init(params)` as one compiled program: each subtree shaped like the params
    (moments, master copies) placed like them, the rest (counts) replicated where they
    live. Run eagerly, every distinct leaf shape would be a program of its own to compile
    at start-up."""
    target = _replicated(params)
    if target is None:  # host arrays
        return commit_like(opt.init(params), params)
    structure = jax.tree.structure(params)
    shapes = [x.shape for x in jax.tree.leaves(params)]
    placed = jax.tree.map(lambda x: x.sharding, params)

    def like_params(x) -> bool:
        return (
            jax.tree.structure(x) == structure
            and [getattr(leaf, "shape", None) for leaf in jax.tree.leaves(x)] == shapes
        )

    out = jax.eval_shape(opt.init, params)
    shardings = jax.tree.map(
        lambda x: placed if like_params(x) else target, out, is_leaf=like_params
    )
    return jax.jit(opt.init, out_shardings=shardings)(params)


def _step_zero(params):
    """The step counter, 0, where the params live (from the host: nothing to compile)."""
    target = _replicated(params)
    return jnp.zeros((), jnp.int32) if target is None else jax.device_put(np.int32(0), target)


def init_train_state(
    params,
    opt: Optimizer,
    critic_params=None,
    critic_optimizer: Optimizer | None = None,
    frozen=None,
) -> TrainState:
    """Fresh optimizer states (sharded like the params). The state OWNS `params`: the
    update donates them, so keep no other reference (copy the reference model's params).
    frozen: LoRA's base weights, shared (the reference and sampler read the same arrays)."""
    critic_opt_state = None
    if critic_params is not None:
        if critic_optimizer is None:
            raise ValueError("init_train_state: critic_params given without critic_optimizer")
        critic_params = commit_like(critic_params, critic_params)
        critic_opt_state = fresh_opt_state(critic_optimizer, critic_params)
    return TrainState(
        step=_step_zero(params),
        params=commit_like(params, params),
        opt_state=fresh_opt_state(opt, params),
        critic_params=critic_params,
        critic_opt_state=critic_opt_state,
        frozen=frozen,
    )
