"""Rollout workers in their own JAX worlds (docs/workers.md).

- `wire`: framed messages over TCP (JSON header, raw arrays, no pickle), the token check.
- `weights`: the trainer's parameters, any layout, to a worker's mesh over the host.
- `serve`: the worker process (`python -m jaxrl_llm.workers.serve`), a stream session.
- `remote`: `RemoteStream`, the `sampling.engine.StepStream` over N workers.
"""
