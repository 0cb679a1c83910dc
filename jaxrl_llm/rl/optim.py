"""The optimizer of the update step: AdamW with global-norm clipping and a learning-rate schedule.

    opt = make_optimizer(learning_rate=1e-6, warmup_steps=10, total_steps=1000,
                         schedule="cosine", weight_decay=0.01, max_grad_norm=1.0)

AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization") after clipping
the gradient to a global norm (Pascanu et al. 2013):

    g <- g * min(1, c / ||g||);   m, v <- Adam moments of g;
    theta <- theta - lr_s * (m_hat / (sqrt(v_hat) + eps) + wd * theta)

Where this departs from `optax.adamw`:
- The learning rate is indexed by the TRAINER step s (one call of the update function),
  not by the optimizer's own update count. One trainer step may take several optimizer
  steps (mini-batches x num_iterations); they all use lr_s, as verl steps its scheduler
  once per training step. So `warmup_steps` and `total_steps` are in trainer steps
  whatever the mini-batch settings, and the logged `optim/lr` is exact. `tx` therefore
  yields the unscaled AdamW direction and the update step multiplies it by -lr_s.
- Weight decay skips norm scales and biases (any parameter whose name contains "norm" or
  "bias"), as HF Trainer and most LM recipes do; decaying RMSNorm scales towards 0 would
  shrink the residual stream.
- Low-precision parameters (bfloat16 / float16, `model.dtype`) get a float32 master copy
  in the optimizer state (`MasterWeights`): the moments and the update are float32, the
  update lands on the master, and the parameters are its rounding. Applied to bfloat16
  weights directly, an update of lr 1e-6 x O(1) is far below their rounding step (~0.4%
  of the weight), so most updates would vanish. Memory: 2 + 4 + 8 bytes per parameter
  (parameters, master, moments) against 4 + 8 in float32.
- `mu_dtype="bfloat16"` stores the first moment in bfloat16: it is updated in float32,
  rounded, and the step's direction is taken from the rounded moment, so the update is
  a function of the stored state. With b1 = 0.9 a step moves the moment by 10% of the
  difference, far above bfloat16's rounding step (~0.4%). (optax's own `mu_dtype`
  multiplies the stored moment by b1 in bfloat16, one more rounding, and takes the
  direction from the unrounded moment, which made XLA read the old moment after the
  new one had overwritten its donated buffer, so it copied the moments: more temporary
  memory than the smaller state saves.) The second moment has no such option:
  b2 = 0.999 moves it by 0.1%, which bfloat16 rounds away, so it would stop decaying.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine", "linear")


class MasterWeights(NamedTuple):
    """Optimizer state for low-precision parameters: their float32 master copy (what the
    updates accumulate in) and the inner optax state, kept over the master."""

    master: Any
    inner: optax.OptState


def _low_precision(params) -> bool:
    return any(
        jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
        for x in jax.tree.leaves(params)
    )


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optax transformation giving the unscaled AdamW direction, and the lr schedule.

    tx: clip -> Adam -> decoupled weight decay (no learning rate; see the module doc).
    schedule: trainer step [] int -> learning rate [] float32.
    """

    tx: optax.GradientTransformation
    schedule: Callable[[jax.Array], jax.Array]

    def init(self, params) -> optax.OptState:
        """The optax state, or `MasterWeights` when any parameter is below float32."""
        if not _low_precision(params):
            return self.tx.init(params)
        # A float32 leaf (e.g. a value head) is copied: astype would alias it, and the
        # update donates the parameters and the optimizer state as separate buffers.
        master = jax.tree.map(
            lambda p: jnp.copy(p) if p.dtype == jnp.float32 else p.astype(jnp.float32), params
        )
        return MasterWeights(master, self.tx.init(master))

    def step(self, grads, opt_state, params, lr):
        """One optimizer step -> (new params, new opt_state). lr: [] float32."""
        if isinstance(opt_state, MasterWeights):
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            direction, inner = self.tx.update(grads, opt_state.inner, opt_state.master)
            master = jax.tree.map(lambda m, d: m - lr * d, opt_state.master, direction)
            params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
            return params, MasterWeights(master, inner)
        direction, opt_state = self.tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda d: -lr * d, direction)
        return optax.apply_updates(params, updates), opt_state


def make_schedule(
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    end_lr_ratio: float = 0.0,
) -> Callable[[jax.Array], jax.Array]:
    """Linear warmup from 0 over `warmup_steps`, then constant / cosine / linear decay to
    `learning_rate * end_lr_ratio` at `total_steps` (all in trainer steps)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(
            f"optim.warmup_steps={warmup_steps}, total_steps={total_steps}: need >= 0 and >= 1"
        )
    if not 0.0 <= end_lr_ratio <= 1.0:
        raise ValueError(f"optim.end_lr_ratio={end_lr_ratio}: must be in [0, 1]")
    end = learning_rate * end_lr_ratio
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1), end
        )
    if schedule == "linear":
        decay = optax.linear_schedule(learning_rate, end, max(total_steps - warmup_steps, 1))
    else:
        decay = optax.constant_schedule(learning_rate)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def decay_mask(params):
    """True for the leaves weight decay applies to: not norm scales, not biases."""

    def keep(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return "norm" not in name and "bias" not in name

    return jax.tree_util.tree_map_with_path(keep, params)


def _scale_by_adam(b1: float, b2: float, eps: float, mu_dtype) -> optax.GradientTransformation:
    """optax's Adam scaling, or with the first moment stored in `mu_dtype`: updated in
    float32, rounded, and the direction taken from the rounded moment (see the module
    doc)."""
    exact = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    if mu_dtype == jnp.float32:
        return exact
    stored = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype)

    def update(grads, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        mu = jax.tree.map(
            lambda g, m: (b1 * m.astype(jnp.float32) + (1 - b1) * g).astype(mu_dtype),
            grads,
            state.mu,
        )
        nu = jax.tree.map(lambda g, v: b2 * v + (1 - b2) * jnp.square(g), grads, state.nu)
        direction = jax.tree.map(
            lambda m, v: (m.astype(jnp.float32) / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps),
            mu,
            nu,
        )
        return direction, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(stored.init, update)


def make_optimizer(
    learning_rate: float = 1e-6,
    warmup_steps: int = 0,
    total_steps: int = 1000,
    schedule: str = "constant",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    end_lr_ratio: float = 0.0,
    mu_dtype: str = "float32",
) -> Optimizer:
    """AdamW + clip_by_global_norm(max_grad_norm) (None or 0 = no clipping) + schedule
    (decaying to learning_rate * end_lr_ratio; the constant schedule ignores it).
    mu_dtype: storage dtype of the first moment, "float32" or "bfloat16"."""
    if learning_rate < 0 or weight_decay < 0:
        raise ValueError(
            f"optim.learning_rate={learning_rate}, weight_decay={weight_decay}: must be >= 0"
        )
    if mu_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"optim.mu_dtype={mu_dtype!r}: expected float32 or bfloat16")
    parts = []
    if max_grad_norm:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(_scale_by_adam(b1, b2, eps, jnp.dtype(mu_dtype)))
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
    sched = make_schedule(learning_rate, warmup_steps, total_steps, schedule, end_lr_ratio)
    return Optimizer(tx=optax.chain(*parts), schedule=lambda s: jnp.asarray(sched(s), jnp.float32))


def optimizer_from_config(optim, num_steps: int, learning_rate: float | None = None) -> Optimizer:
    """`make_optimizer` from a run config's `optim` section; the schedule counts
    `num_steps` trainer steps. learning_rate: default `optim.learning_rate` (PPO's critic
    passes `optim.critic_learning_rate`)."""
    return make_optimizer(
        learning_rate=optim.learning_rate if learning_rate is None else learning_rate,
        warmup_steps=optim.warmup_steps,
        total_steps=num_steps,
        schedule=optim.schedule,
        weight_decay=optim.weight_decay,
        b1=optim.b1,
        b2=optim.b2,
        eps=optim.eps,
        max_grad_norm=optim.max_grad_norm,
        end_lr_ratio=optim.end_lr_ratio,
        mu_dtype=optim.mu_dtype,
    )
