"""Start-up: the layer that makes the first step come sooner, at the edge of the trainer.

- `compilation`: XLA's persistent compilation cache, one line per compiled program, and
  the step's programs compiled ahead of their first call in threads (`CompileLog`).
- `precompile`: which programs a run's first step needs, at which shapes.
- `peak`: the matmul peak MFU divides by, kept per machine next to the cache.

It wraps the core's plain `jax.jit` programs from outside, on jax's public API only;
nothing in the core (models, sampling, rl, envs, verifiers, data) imports it. Deleting
it would leave a trainer that compiles each program at its first call.
"""
