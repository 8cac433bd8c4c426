"""``remote``: asks an HTTP service for rewards (a sandbox, a reward-model server, an LLM judge).

Per sample (default) it POSTs ``{"prompt", "completion", <every dataset column>}`` as JSON and reads back a
number, ``null`` ("not applicable"), or an object with a ``reward`` (or ``score``) field; up to
``max_concurrency`` requests are in flight at once. With ``batch`` it POSTs one request per batch,
``{"prompts": [...], "completions": [...], <column>: [...]}``, and reads back a list or ``{"rewards": [...]}``.
Each request has a total deadline, ``timeout`` seconds from connecting to the last byte of the answer (a server
that answers a byte at a time is cut off there, not after each byte); connection errors, timeouts, HTTP 5xx and
429 are retried ``max_retries`` times with exponential back-off; other 4xx are not (they will not get better). A
sample whose request still fails gets ``None``, is counted in ``judger/failures`` and the first such error is
logged. ``completion`` is the completion's text; token ids are not sent.

The judger talks only to the host it was given: a redirect is followed only when it keeps the method and the
body (307, 308) and stays on the same scheme, host and port; any other redirect is a failed request, so the
headers (an ``Authorization``, say) never reach another host and no reward comes from one. When the judger is
built (at the start of a run) it connects to the service once: an address nothing answers on ends the run there,
with one line. Requests run in daemon threads, so none keeps the process alive after the run. Uses only the
standard library (``http.client``), so no extra to install.
"""

from __future__ import annotations

import http.client
import json
import logging
import numbers
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from rlflow.config_error import ConfigError
from rlflow.judgers.base import Judger, completion_text

log = logging.getLogger(__name__)
#: Redirects followed per request (307/308 within the same origin only).
MAX_REDIRECTS = 3
#: The largest answer read; a longer one is a failed request.
MAX_ANSWER_BYTES = 16 * 2**20
#: Seconds the check at start-up waits for the service to accept a connection (at most ``timeout``).
CONNECT_CHECK_SECONDS = 10.0


class RemoteJudgerError(RuntimeError):
    """The reward service failed or answered something that is not a reward; ``retry``: whether another attempt
    may succeed (a connection error, a timeout, HTTP 5xx or 429)."""

    def __init__(self, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


def origin(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of an http(s) URL, with the scheme's default port filled in."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def shown(url: str) -> str:
    """``url`` as messages show it: without a ``user:password@`` part and with every query value replaced by
    ``***`` (an ``api_key=...`` in the query stays out of logs)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = urllib.parse.urlencode([(k, "***") for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)],
                                   safe="*")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _map_in_daemon_threads(fn: Callable[[int], Any], n: int, workers: int) -> list[Any]:
    """``[fn(i) for i in range(n)]`` on up to ``workers`` daemon threads (which never keep the process alive,
    unlike a ThreadPoolExecutor's, joined at exit); an exception of ``fn`` is raised here."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    todo = iter(range(n))
    lock = threading.Lock()

    def work() -> None:
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(i)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                errors.append(exc)

    threads = [threading.Thread(target=work, name="rlflow-remote-judger", daemon=True)
               for _ in range(min(workers, n))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _reward(value: Any, where: str) -> float | None:
    if isinstance(value, dict):
        key = "reward" if "reward" in value else "score" if "score" in value else None
        if key is None:
            raise RemoteJudgerError(f"{where}: the answer object has no 'reward' or 'score' field: {value!r}"[:300])
        value = value[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RemoteJudgerError(f"{where}: the reward {value!r} is not a number or null"[:300])
    return float(value)


class RemoteJudger(Judger):
    """Rewards from an HTTP endpoint, with a timeout per request and bounded retries.

    Args:
        url: The endpoint to POST to, e.g. ``http://127.0.0.1:8000/reward``.
        timeout: Seconds one request may take in all: connecting, sending, and the whole answer.
        max_retries: Extra attempts after a failed request (connection error, timeout, 5xx, 429).
        backoff: Seconds before the first retry; doubled before each further one.
        batch: Send the whole batch in one request instead of one request per sample.
        max_concurrency: Requests in flight at once in per-sample mode.
        headers: Extra HTTP headers. Their values are saved with the run's config (``config.yaml``, the
            checkpoints, a W&B run's config): put a secret in ``headers_from_env`` instead.
        headers_from_env: Headers whose values are read from environment variables when the judger is built,
            ``{header: VARIABLE}``, e.g. ``{Authorization: REWARD_API_AUTH}`` with
            ``REWARD_API_AUTH="Bearer ..."`` set in the environment: only the variable's name is saved.
        name: Metric name of this judger (``rewards/<name>/mean``).
    """

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        max_retries: int = 2,
        backoff: float = 0.5,
        batch: bool = False,
        max_concurrency: int = 8,
        headers: dict[str, str] | None = None,
        headers_from_env: dict[str, str] | None = None,
        name: str = "remote",
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote judger: url must start with http:// or https://, got {shown(url)!r}")
        if timeout <= 0 or max_retries < 0 or backoff < 0 or max_concurrency < 1:
            raise ValueError(
                "remote judger: timeout > 0, max_retries >= 0, backoff >= 0 and max_concurrency >= 1 are required"
            )
        if not urllib.parse.urlsplit(url).hostname:
            raise ValueError(f"remote judger: url {shown(url)!r} names no host")
        missing = sorted(var for var in (headers_from_env or {}).values() if not os.environ.get(var))
        if missing:
            raise ConfigError(f"data.judging.judgers: the remote judger {name!r} reads headers_from_env from "
                              f"{', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not set")
        self.url = url
        self.shown_url = shown(url)
        saved = [h for h in (headers or {}) if any(w in h.lower() for w in ("auth", "key", "token", "secret"))]
        if saved or "@" in urllib.parse.urlsplit(url).netloc:
            what = f"header(s) {', '.join(saved)}" if saved else "the user:password in its url"
            log.warning("remote judger %r: %s will be saved with the run's config (config.yaml, checkpoints, the "
                        "logger's config); pass secrets through headers_from_env", name, what)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.batch = batch
        self.max_concurrency = int(max_concurrency)
        self.headers = {"Content-Type": "application/json", **(headers or {}),
                        **{h: os.environ[var] for h, var in (headers_from_env or {}).items()}}
        self.name = name
        self._failed: list[int] = []  # positions in the current call of the samples whose request failed
        self._logged = False
        self._lock = threading.Lock()
        self.check_reachable()

    def check_reachable(self) -> None:
        """Connect to the service once (no request is sent): a ConfigError, one line, when nothing answers."""
        _, host, port = origin(self.url)
        try:
            socket.create_connection((host, port), timeout=min(self.timeout, CONNECT_CHECK_SECONDS)).close()
        except OSError as exc:
            raise ConfigError(
                f"data.judging.judgers: the remote judger {self.name!r} cannot reach {self.shown_url} "
                f"({type(exc).__name__}: {exc}); start the reward service first, or fix its url"
            ) from exc

    def exchange(self, url: str, data: bytes, deadline: float) -> tuple[int, str, str | None, bytes]:
        """One POST of ``data`` to ``url``, ended at ``deadline`` (``time.monotonic()``) whatever the server does:
        ``(status, reason, Location header, body)``. RemoteJudgerError (to retry) when it fails or times out."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RemoteJudgerError(f"{shown(url)} did not answer within the timeout of {self.timeout} s", retry=True)
        parts = urllib.parse.urlsplit(url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname, parts.port, timeout=left)
        expired = threading.Event()
        sockets: list[socket.socket] = []  # the connection's (http.client lets go of it once an answer arrives)

        def expire() -> None:  # wakes a read blocked on a slow server: the socket is shut down under it
            expired.set()
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(left, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            sockets.append(conn.sock)
            if expired.is_set():  # the deadline passed while connecting, before there was a socket to shut
                raise TimeoutError
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("POST", path, body=data, headers=self.headers)
            response = conn.getresponse()
            body = response.read(MAX_ANSWER_BYTES + 1)
            if expired.is_set():
                raise TimeoutError
            if len(body) > MAX_ANSWER_BYTES:
                raise RemoteJudgerError(f"{shown(url)} answered more than {MAX_ANSWER_BYTES} bytes")
            return response.status, response.reason, response.getheader("Location"), body
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut off at the deadline
            if expired.is_set() or isinstance(exc, TimeoutError):
                raise RemoteJudgerError(f"{shown(url)} did not answer within the timeout of {self.timeout} s",
                                        retry=True) from exc
            raise RemoteJudgerError(f"{shown(url)} failed: {type(exc).__name__}: {exc}", retry=True) from exc
        finally:
            watchdog.cancel()
            conn.close()

    def attempt(self, data: bytes) -> Any:
        """One request, within one deadline, following same-origin 307/308 redirects only; the decoded answer."""
        deadline = time.monotonic() + self.timeout
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            status, reason, location, body = self.exchange(url, data, deadline)
            if status in (301, 302, 303, 307, 308):
                target = urllib.parse.urljoin(url, location or "")
                if status in (307, 308) and location and origin(target) == origin(self.url):
                    url = target
                    continue
                raise RemoteJudgerError(
                    f"{shown(url)} answered HTTP {status} redirecting to {shown(target)}: the remote judger follows "
                    "only 307/308 redirects on its own scheme, host and port, so that its headers and rewards stay "
                    "with {}://{}:{}; set url to the service's own address".format(*origin(self.url))
                )
            if status >= 400:
                raise RemoteJudgerError(f"{shown(url)} answered HTTP {status} {reason}",
                                        retry=status >= 500 or status == 429)
            try:
                return json.loads(body)
            except ValueError as exc:
                raise RemoteJudgerError(f"{shown(url)} answered something that is not JSON: {body[:200]!r}") from exc
        raise RemoteJudgerError(f"{self.shown_url} redirected more than {MAX_REDIRECTS} times")

    def post(self, payload: Any) -> Any:
        """POST ``payload`` as JSON and return the decoded answer, retrying what may succeed on a second try."""
        data = json.dumps(payload).encode("utf-8")
        attempt = 0
        while True:
            try:
                return self.attempt(data)
            except RemoteJudgerError as exc:
                if not exc.retry or attempt == self.max_retries:
                    raise RemoteJudgerError(f"{exc} (after {attempt + 1} attempt(s))") from exc
            time.sleep(self.backoff * 2**attempt)
            attempt += 1

    def consume_failed(self) -> list[int]:
        """Positions (in the call) of the samples given ``None`` because their request failed, since the last call
        (read by the runner: it marks exactly those, not a sample the server answered ``null`` for)."""
        with self._lock:
            positions, self._failed = self._failed, []
        return positions

    def consume_failures(self) -> int:
        """How many samples :meth:`consume_failed` would name (and consumes them)."""
        return len(self.consume_failed())

    def _one(self, position: int, payload: dict[str, Any]) -> float | None:
        try:
            return _reward(self.post(payload), self.shown_url)
        except RemoteJudgerError as exc:
            with self._lock:
                self._failed.append(position)
                first, self._logged = not self._logged, True
            if first:
                log.warning(
                    "remote judger %r: a request failed, its sample gets no reward (logged once): %s", self.name, exc
                )
            return None

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        columns.pop("completion_ids", None)
        columns = {k: v for k, v in columns.items() if isinstance(v, (list, tuple))}
        texts = [completion_text(c) for c in completions]
        if self.batch:
            payload = {"prompts": list(prompts), "completions": texts, **{k: list(v) for k, v in columns.items()}}
            answer = self.post(payload)
            rewards = answer.get("rewards") if isinstance(answer, dict) else answer
            if not isinstance(rewards, list) or len(rewards) != len(texts):
                raise RemoteJudgerError(
                    f"{self.shown_url} must answer a list of {len(texts)} rewards (or {{'rewards': [...]}}), "
                    f"got {str(answer)[:200]}"
                )
            return [_reward(r, self.shown_url) for r in rewards]
        payloads = [
            {"prompt": prompts[i], "completion": texts[i], **{k: v[i] for k, v in columns.items()}}
            for i in range(len(texts))
        ]
        return _map_in_daemon_threads(lambda i: self._one(i, payloads[i]), len(payloads), self.max_concurrency)
