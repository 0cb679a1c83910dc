"""Rollout workers in their own JAX worlds (docs/workers.md).

- `wire`: framed messages over TCP (JSON header, raw arrays, no pickle), the token check.
- `weights`: the trainer's parameters, any layout, to a worker's mesh over the host.
- `serve`: the worker process (`python -m jaxrl_llm.workers.serve`), a stream or turns
  session per trainer connection.
- `fleet`: `Fleet`, the trainer's connections to N workers and the weights they hold.
- `remote`: `RemoteStream`, the `sampling.engine.StepStream` over a fleet.
- `turns`: `RemoteTurns`, the `sampling.engine.TurnRows` over a fleet (environments),
  and `RemoteRequests` (agents); `serve_turns`, the worker's side of both.
"""
