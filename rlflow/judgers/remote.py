"""``remote``: asks an HTTP service for rewards (a sandbox, a reward-model server, an LLM judge).

Per sample (default) it POSTs ``{"prompt", "completion", <every dataset column>}`` as JSON and reads back a
number, ``null`` ("not applicable"), or an object with a ``reward`` (or ``score``) field; up to
``max_concurrency`` requests are in flight at once. With ``batch`` it POSTs one request per batch,
``{"prompts": [...], "completions": [...], <column>: [...]}``, and reads back a list or ``{"rewards": [...]}``.
Each request has a ``timeout``; connection errors, timeouts, HTTP 5xx and 429 are retried ``max_retries`` times
with exponential back-off; other 4xx are not (they will not get better). A sample whose request still fails
gets ``None``, is counted in ``judger/failures`` and the first such error is logged. ``completion`` is the
completion's text; token ids are not sent. Uses only the standard library (``urllib``), so no extra to install.
"""

from __future__ import annotations

import json
import logging
import numbers
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlflow.judgers.base import Judger, completion_text

log = logging.getLogger(__name__)


class RemoteJudgerError(RuntimeError):
    """The reward service failed or answered something that is not a reward."""


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
        timeout: Seconds to wait for one HTTP answer.
        max_retries: Extra attempts after a failed request (connection error, timeout, 5xx, 429).
        backoff: Seconds before the first retry; doubled before each further one.
        batch: Send the whole batch in one request instead of one request per sample.
        max_concurrency: Requests in flight at once in per-sample mode.
        headers: Extra HTTP headers (e.g. ``Authorization``).
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
        name: str = "remote",
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote judger: url must start with http:// or https://, got {url!r}")
        if timeout <= 0 or max_retries < 0 or backoff < 0 or max_concurrency < 1:
            raise ValueError(
                "remote judger: timeout > 0, max_retries >= 0, backoff >= 0 and max_concurrency >= 1 are required"
            )
        self.url = url
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.batch = batch
        self.max_concurrency = int(max_concurrency)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.name = name
        self._failed: list[int] = []  # positions in the current call of the samples whose request failed
        self._logged = False
        self._lock = threading.Lock()

    def post(self, payload: Any) -> Any:
        """POST ``payload`` as JSON and return the decoded answer, retrying what may succeed on a second try."""
        data = json.dumps(payload).encode("utf-8")
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=data, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as exc:
                error = RemoteJudgerError(f"{self.url} answered HTTP {exc.code} {exc.reason}")
                if exc.code < 500 and exc.code != 429:
                    break
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:  # refused, reset, timed out
                reason = getattr(exc, "reason", exc)
                error = RemoteJudgerError(f"{self.url} failed: {type(reason).__name__}: {reason}")
                continue
            try:
                return json.loads(body)
            except ValueError as exc:
                raise RemoteJudgerError(f"{self.url} answered something that is not JSON: {body[:200]!r}") from exc
        raise RemoteJudgerError(f"{error} (after {attempt + 1} attempt(s))") from error

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
            return _reward(self.post(payload), self.url)
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
                    f"{self.url} must answer a list of {len(texts)} rewards (or {{'rewards': [...]}}), "
                    f"got {str(answer)[:200]}"
                )
            return [_reward(r, self.url) for r in rewards]
        payloads = [
            {"prompt": prompts[i], "completion": texts[i], **{k: v[i] for k, v in columns.items()}}
            for i in range(len(texts))
        ]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(payloads), 1))) as pool:
            return list(pool.map(self._one, range(len(payloads)), payloads))
