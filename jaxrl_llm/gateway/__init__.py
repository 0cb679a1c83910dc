"""An OpenAI-compatible gateway over the policy: agents written against the `openai`
client are trained through it (docs/agents.md).

`rollout.agents.AgentRollout` (agent.entry) plays a step's episodes through it.
`server.Server` is the HTTP endpoint (aiohttp, localhost; a key per episode),
`launcher.Launcher` runs each episode's agent in a process of its own,
`episodes.Episode` keeps one episode's exact tokens (`episodes.Play`: a batch of them in
progress), `envs.tool_calls.parse_tool_calls`
reads tool calls in the model's format. It imports nothing from the trainer or the
rollout wing.
"""

from jaxrl_llm.envs.tool_calls import ParsedCalls, parse_tool_calls
from jaxrl_llm.gateway.episodes import Episode, group_rows

__all__ = ["Episode", "ParsedCalls", "group_rows", "parse_tool_calls"]
