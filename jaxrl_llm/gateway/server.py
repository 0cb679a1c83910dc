"""An OpenAI-compatible HTTP endpoint on localhost, and the agents it serves.

    server = Server()                                  # aiohttp, its own thread and loop
    tasks = server.run_episodes(agent, examples, timeout_s)   # {episode id: future}
    request = server.requests.get()                    # (episode id, body, reply)
    reply(200, {...})                                  # answers that HTTP request

Each episode has a base URL of its own, `http://127.0.0.1:PORT/e/<id>/v1`, so a request
says which episode it belongs to without anything in the body; an agent is handed an
`openai.AsyncOpenAI` client on that URL (the clients share one httpx connection pool:
making a client with a pool of its own loads the TLS certificates, tens of milliseconds
per episode). `POST .../chat/completions` puts the request
(its parsed JSON) on `requests`, a thread-safe queue, and waits until the trainer's
thread answers it (`reply`); the answer is the HTTP response. Nothing is streamed.

The agents run as tasks on the server's event loop, so any number of them wait on the
model at once; an agent that raises or passes its time limit ends its episode, and only
that one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading


class Server:
    """The gateway's HTTP server (aiohttp) on 127.0.0.1, on a free port, in a thread."""

    def __init__(self, host: str = "127.0.0.1"):
        from aiohttp import web

        self.requests: queue.Queue = queue.Queue()
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count()
        self._live: set[str] = set()
        self._agents: dict = {}  # the agents served, for their `aclose` at close
        self._http = None  # the episodes' clients' shared httpx pool (made on the loop)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/e/{episode}/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(host, started), daemon=True,
                                        name="gateway")  # fmt: skip
        self._thread.start()
        started.wait()
        if self._error is not None:
            raise self._error

    def _serve(self, host: str, started: threading.Event) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self.loop)
        self._error = None
        try:
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, host, 0)
            self.loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as err:  # noqa: BLE001  (raised in the caller's thread)
            self._error = err
            started.set()
            return
        started.set()
        self.loop.run_forever()

    def url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/e/{episode}/v1"

    async def _completions(self, request):
        from aiohttp import web

        episode = request.match_info["episode"]
        if episode not in self._live:
            return _error(web, 404, f"no episode {episode!r} in progress")
        try:
            body = json.loads(await request.read())
        except ValueError as err:
            return _error(web, 400, f"the body is not JSON: {err}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(web, 400, "the body must be an object with a 'messages' list")
        done = self.loop.create_future()

        def reply(status: int, payload: dict) -> None:  # from the trainer's thread
            self.loop.call_soon_threadsafe(_resolve, done, (status, payload))

        self.requests.put((episode, body, reply))
        status, payload = await done
        return web.json_response(payload, status=status)

    def run_episodes(self, agent, examples: list, timeout_s: float) -> dict:
        """Starts `agent(client, example)` for each example -> {episode id: a
        concurrent future of (reward | None, error text, "done" | "error" | "timeout")}."""
        futures = {}
        self._agents.setdefault(id(agent), agent)
        for example in examples:
            episode = f"{next(self._ids)}"
            self._live.add(episode)
            coro = self._episode(agent, episode, example, timeout_s)
            futures[episode] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return futures

    async def _episode(self, agent, episode: str, example, timeout_s: float):
        import httpx
        import openai

        if self._http is None:  # one connection pool for every episode's client
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        client = openai.AsyncOpenAI(base_url=self.url(episode), api_key="jaxrl-llm",
                                    max_retries=0, timeout=timeout_s,
                                    http_client=self._http)  # fmt: skip
        try:
            reward = await asyncio.wait_for(agent(client, example), timeout_s)
            return _reward(reward), "", "done"
        except asyncio.TimeoutError:
            return None, f"the agent passed agent.timeout_s={timeout_s}", "timeout"
        except Exception as err:  # noqa: BLE001  (that episode fails, the run goes on)
            return None, f"{type(err).__name__}: {err}"[:500], "error"
        finally:  # the client's pool is the server's, closed with it
            self._live.discard(episode)

    def close(self) -> None:
        """Stops the server; an agent with an `aclose` coroutine (resources it keeps per
        event loop, e.g. `verifiers_env.VerifiersAgent`) gets it run on this loop first."""
        if self.loop.is_running():
            for agent in self._agents.values():
                if hasattr(agent, "aclose"):
                    try:
                        asyncio.run_coroutine_threadsafe(agent.aclose(), self.loop).result(30)
                    except Exception:  # noqa: BLE001  (the server still closes)
                        pass
            if self._http is not None:
                asyncio.run_coroutine_threadsafe(self._http.aclose(), self.loop).result(10)
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def _reward(value) -> float:
    reward = float(value)
    if reward != reward or abs(reward) == float("inf"):
        raise ValueError(f"the agent returned {value!r}, not a finite number")
    return reward


def _resolve(future, value) -> None:
    if not future.done():
        future.set_result(value)


def _error(web, status: int, message: str):
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}},
                             status=status)  # fmt: skip
