"""An OpenAI-compatible HTTP endpoint on localhost, and the agents' episodes it serves.

    server = Server(entry, options, max_request_bytes)   # aiohttp, its own thread and loop
    tasks = server.run_episodes(examples, timeout_s)     # {episode id: future}
    request = server.requests.get()                      # (episode id, body, reply)
    reply(200, {...})                                    # answers that HTTP request

Each episode has a base URL of its own, `http://127.0.0.1:PORT/e/<id>/v1`, and a key of
its own (`secrets.token_urlsafe`), which its agent's `openai.AsyncOpenAI` client sends
as `Authorization: Bearer <key>`. A request without its episode's key is refused (401),
one for an episode not in progress too (404); both are counted (`refused`), so no other
local process, and no other episode, can post into an episode. `POST
.../chat/completions` puts the request (its parsed JSON) on `requests`, a thread-safe
queue, and waits until the trainer's thread answers it (`reply`); the answer is the HTTP
response. Nothing is streamed. An episode's requests are answered one at a time, in
the order they came; a body over `max_request_bytes` is refused (413) before it is read
whole (`too_large`), and requests still queued when their episode ends are dropped
unanswered by the model (`dropped`).

The agents run in processes of their own (`launcher`): one per episode, so a crash,
an exit, a hang or a fork costs that episode only. An episode ends when its process
posts its result (`POST /e/<id>/result`), when the process ends without one (an error,
`agent_exits`), or when it passes `timeout_s`: the watchdog then kills the process and
everything below it (a timeout). `timeout_s` bounds the agent's own time: the time an
episode's requests wait for the model (the queue, the sampler's compiles, the other
episodes' tokens) does not count, so a slow or loaded trainer never times an agent out.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hmac
import itertools
import json
import queue
import secrets
import threading
import time

from jaxrl_llm.gateway.launcher import Launcher

WATCHDOG_S = 0.1  # how often the watchdog looks at the episodes' clocks


@dataclasses.dataclass
class _Episode:
    key: str
    future: concurrent.futures.Future
    started: float
    timeout_s: float
    lock: asyncio.Lock
    pid: int | None = None
    waited: float = 0.0  # seconds its answered requests waited for the model
    pending: int = 0  # its requests not answered yet
    pending_since: float = 0.0  # when the oldest of them came

    def elapsed(self, now: float) -> float:
        """The agent's own seconds since the episode started: the wall time less the
        time its requests waited for the model."""
        waiting = now - self.pending_since if self.pending else 0.0
        return now - self.started - self.waited - waiting

    def asked(self) -> None:
        if not self.pending:
            self.pending_since = time.monotonic()
        self.pending += 1

    def answered(self) -> None:
        self.pending -= 1
        if not self.pending:
            self.waited += time.monotonic() - self.pending_since


class Requests:
    """The requests waiting for the model (a thread-safe queue): `get` drops (answers 404
    and counts) those whose episode ended while they waited."""

    def __init__(self, server: Server):
        self._queue: queue.Queue = queue.Queue()
        self._server = server

    def put(self, item) -> None:
        self._queue.put(item)

    def empty(self) -> bool:
        return self._queue.empty()

    def get_nowait(self):
        return self.get(timeout=0)

    def get(self, timeout: float | None = None):
        """The next request of an episode in progress; queue.Empty past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self._queue.get(block=left != 0, timeout=left)
            if item[0] in self._server.live:
                return item
            self._server.counts["dropped"] += 1
            item[2](404, _body(f"episode {item[0]} has ended"))


class Server:
    """The gateway's HTTP server (aiohttp) on 127.0.0.1, on a free port, in a thread;
    `entry` and `options`: the agent its episodes run (`launcher`)."""

    def __init__(
        self,
        entry: str,
        options: dict | None = None,
        *,
        max_request_bytes: int = 2**22,
        host: str = "127.0.0.1",
    ):
        from aiohttp import web

        self.entry, self.options = entry, dict(options or {})
        self.max_request_bytes = max_request_bytes
        self.requests = Requests(self)
        self.counts: collections.Counter = collections.Counter()
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count()
        self.live: dict[str, _Episode] = {}
        self._waiting: set = set()  # futures of requests not answered yet
        self._outbox: collections.deque = collections.deque()  # replies for the loop
        self._flushing = False  # a `_flush` is scheduled on the loop
        self._launcher: Launcher | None = None
        app = web.Application(client_max_size=max_request_bytes)
        app.router.add_post("/e/{episode}/v1/chat/completions", self._completions)
        app.router.add_post("/e/{episode}/result", self._result)
        self._runner = web.AppRunner(app, access_log=None)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(host, started), daemon=True, name="gateway"
        )
        self._thread.start()
        started.wait()
        if self._error is not None:
            raise self._error
        self._watchdog = asyncio.run_coroutine_threadsafe(self._watch(), self.loop)

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

    def take_counts(self) -> dict:
        """The refusals since the last call: `refused` (no or another episode's key, or
        no such episode), `too_large`, `dropped`, `agent_exits`."""
        names = ("refused", "too_large", "dropped", "agent_exits")
        counts = {k: self.counts[k] for k in names}
        self.counts.subtract(counts)
        return counts

    def _authorized(self, request, web):
        """The request's episode when it carries that episode's key, else an error response."""
        episode = request.match_info["episode"]
        ep = self.live.get(episode)
        if ep is None:
            self.counts["refused"] += 1
            return None, _error(web, 404, f"no episode {episode!r} in progress")
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {ep.key}".encode()):
            self.counts["refused"] += 1
            return None, _error(web, 401, f"episode {episode}: missing or wrong key")
        return ep, None

    async def _read_json(self, request, web):
        """(the body as JSON, None) or (None, an error response): 413 past the limit."""
        try:
            return json.loads(await request.read()), None
        except web.HTTPRequestEntityTooLarge:
            self.counts["too_large"] += 1
            message = (
                f"the body is over agent.max_request_bytes={self.max_request_bytes}"
                f" ({request.content_length} bytes)"
            )
            return None, _error(web, 413, message)
        except ValueError as err:
            return None, _error(web, 400, f"the body is not JSON: {err}"[:500])

    async def _open(self, request, web):
        """(episode, body, None) for a request with its episode's key and a JSON body,
        else (None, None, the error response)."""
        ep, refused = self._authorized(request, web)
        if refused is not None:
            return None, None, refused
        body, bad = await self._read_json(request, web)
        return ep, body, bad

    async def _completions(self, request):
        from aiohttp import web

        ep, body, refused = await self._open(request, web)
        if refused is not None:
            return refused
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(web, 400, "the body must be an object with a 'messages' list")
        episode = request.match_info["episode"]
        ep.asked()
        try:
            return await self._complete(web, ep, episode, body)
        finally:
            ep.answered()

    async def _complete(self, web, ep: _Episode, episode: str, body: dict):
        async with ep.lock:  # one request of an episode at a time, in order
            if episode not in self.live:
                self.counts["dropped"] += 1
                return _error(web, 404, f"episode {episode} has ended")
            done = self.loop.create_future()
            self._waiting.add(done)

            def reply(status: int, payload: dict) -> None:  # from the trainer's thread
                self._outbox.append((done, (status, payload)))
                if not self._flushing:  # one wake-up of the loop for a chunk's answers
                    self._flushing = True
                    self.loop.call_soon_threadsafe(self._flush)

            self.requests.put((episode, body, reply))
            status, payload = await done
        return web.json_response(payload, status=status)

    def _flush(self) -> None:
        """Answers the requests the trainer's thread replied to (on the loop). The flag
        drops before the outbox is read, so a reply appended after this read schedules
        another flush."""
        self._flushing = False
        while self._outbox:
            self._answer(*self._outbox.popleft())

    def _answer(self, done, value) -> None:
        self._waiting.discard(done)
        if not done.done():
            done.set_result(value)

    async def _result(self, request):
        """The episode's process reports what its agent returned (or raised)."""
        from aiohttp import web

        _, body, refused = await self._open(request, web)
        if refused is not None:
            return refused
        if isinstance(body, dict) and isinstance(body.get("reward"), float):
            self._end(request.match_info["episode"], (body["reward"], "", "done"))
        else:
            error = body.get("error") if isinstance(body, dict) else None
            self._end(request.match_info["episode"], (None, str(error)[:500], "error"))
        return web.json_response({})

    def _end(self, episode: str, result) -> None:
        """Ends an episode in progress with `result` (on the loop); later ends are no-ops."""
        ep = self.live.pop(episode, None)
        if ep is not None:
            ep.future.set_result(result)

    def abandon(self, episodes, why: str) -> None:
        """Ends those of `episodes` still in progress as errors (`why`) and kills their
        agents' processes: a play given up, to be played again with new episodes."""

        def end():
            for episode in episodes:
                ep = self.live.get(episode)
                if ep is not None:
                    self._end(episode, (None, why, "error"))
                    if ep.pid is not None:
                        Launcher.kill(ep.pid)

        self.loop.call_soon_threadsafe(end)

    def run_episodes(self, examples: list, timeout_s: float) -> dict:
        """Starts the agent on each example, each in a process of its own -> {episode
        id: a concurrent future of (reward | None, error text, "done" | "error" |
        "timeout")}."""
        if self._launcher is None or not self._launcher.alive:
            self._launcher = Launcher(self.entry, self.options, self._on_started, self._on_exited)
        started, futures, made = time.monotonic(), {}, []
        for _ in examples:  # all in progress before any agent can look for another
            episode = f"{next(self._ids)}"
            ep = _Episode(
                key=secrets.token_urlsafe(24),
                future=concurrent.futures.Future(),
                started=started,
                timeout_s=timeout_s,
                lock=asyncio.Lock(),
            )
            futures[episode], self.live[episode] = ep.future, ep
            made.append((episode, ep))
        for (episode, ep), example in zip(made, examples, strict=True):
            result_url = f"http://127.0.0.1:{self.port}/e/{episode}/result"
            if not self._launcher.run(episode, self.url(episode), ep.key, result_url, example):
                self._on_exited(episode, None)
        return futures

    def _on_started(self, episode: str, pid: int) -> None:  # the launcher's reader thread
        def started():
            if episode in self.live:
                self.live[episode].pid = pid
            else:  # timed out before it started
                Launcher.kill(pid)

        self.loop.call_soon_threadsafe(started)

    def _on_exited(self, episode: str, code) -> None:  # the launcher's reader thread
        def exited():
            if episode in self.live:
                self.counts["agent_exits"] += 1
                how = "the agent process is gone" if code is None else f"exit code {code}"
                self._end(
                    episode,
                    (
                        None,
                        f"the agent's process ended ({how}) without returning a reward",
                        "error",
                    ),
                )

        self.loop.call_soon_threadsafe(exited)

    async def _watch(self) -> None:
        """Ends each episode past its timeout and kills its process tree."""
        while True:
            await asyncio.sleep(WATCHDOG_S)
            now = time.monotonic()
            for episode, ep in list(self.live.items()):
                if ep.elapsed(now) > ep.timeout_s:
                    self._end(
                        episode,
                        (None, f"the agent passed agent.timeout_s={ep.timeout_s:g}", "timeout"),
                    )
                    if ep.pid is not None:
                        Launcher.kill(ep.pid)

    def close(self) -> None:
        """Stops the server and every agent process; never raises (it runs while another
        error may be on its way out)."""
        if self._launcher is not None:
            self._launcher.close()
        if not self.loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shut(), self.loop).result(15)
        except Exception:  # noqa: BLE001  (a stuck shutdown must not hide the run's error)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _shut(self) -> None:
        self._watchdog.cancel()
        for done in list(self._waiting):  # requests the trainer will not answer now
            self._answer(done, (503, _body("the gateway is closing")))
        for episode in list(self.live):
            self._end(episode, (None, "the gateway closed", "error"))
        await self._runner.cleanup()


def _body(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _error(web, status: int, message: str):
    return web.json_response(_body(message), status=status)
