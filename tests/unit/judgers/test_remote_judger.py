"""The ``remote`` judger against real HTTP servers started on 127.0.0.1: answers, hangs, 500s, 4xx, bad JSON."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlflow.judgers.remote import RemoteJudger, RemoteJudgerError
from rlflow.judgers.runner import JudgerRunner


class RewardServer:
    """A reward service on a random local port; each path behaves differently; every request is recorded."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, object]] = []
        self.auth: list[str | None] = []  # each request's Authorization header
        self.release = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, body))
                    server.auth.append(self.headers.get("Authorization"))
                    attempts = sum(1 for p, _ in server.requests if p == self.path)
                if self.path == "/hang":
                    server.release.wait(20)
                    return self.reply(200, {"reward": 1.0})
                if self.path.startswith("/500"):
                    return self.reply(500, {"error": "boom"})
                if self.path == "/404":
                    return self.reply(404, {"error": "no such route"})
                if self.path == "/flaky" and attempts == 1:
                    return self.reply(503, {"error": "warming up"})
                if self.path == "/notjson":
                    return self.reply(200, "<html>oops</html>", raw=True)
                if self.path == "/batch":
                    pairs = zip(body["completions"], body["ground_truth"])
                    return self.reply(200, {"rewards": [float(c.endswith(t)) for c, t in pairs]})
                if self.path == "/shortbatch":
                    return self.reply(200, [1.0])
                # per sample: 1.0 when the completion ends with the ground truth; null when there is none; a 500
                # for the ground truth "FAIL"
                if body.get("ground_truth") == "FAIL":
                    return self.reply(500, {"error": "cannot grade this one"})
                if body.get("ground_truth") is None:
                    return self.reply(200, {"reward": None})
                return self.reply(200, {"reward": float(body["completion"].endswith(body["ground_truth"]))})

            def reply(self, code, payload, raw=False):
                data = (payload if raw else json.dumps(payload)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.requests if p == path)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.close()


def remote(server, path, **init_args):
    args = {"url": server.url + path, "timeout": 0.5, "max_retries": 2, "backoff": 0.0, **init_args}
    return {"class_path": "remote", "init_args": args}


PROMPTS = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
COMPLETIONS = [[{"role": "assistant", "content": text}] for text in ("is 4", "is 5", "is 6", "is 7")]
COLUMNS = {"data_source": ["s"] * 4, "ground_truth": ["4", "4", "6", None], "extra_info": [{"i": i} for i in range(4)]}
IDS = [[1, 2]] * 4


def test_per_sample_rewards_and_payload(server):
    runner = JudgerRunner({"*": remote(server, "/reward")})
    result = runner.judge(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert result.per_judger["remote"] == [1.0, 0.0, 1.0, None]  # null means "not applicable"
    assert result.rewards == [1.0, 0.0, 1.0, 0.0] and result.metrics["judger/failures"] == 0
    assert server.count("/reward") == 4
    body = next(b for _, b in server.requests if b["ground_truth"] == "6")
    assert body["completion"] == "is 6" and body["prompt"] == [{"role": "user", "content": "q2"}]
    assert body["extra_info"] == {"i": 2} and body["data_source"] == "s" and "completion_ids" not in body


def test_only_the_samples_whose_request_failed_are_marked_not_the_null_ones(server):
    runner = JudgerRunner({"*": remote(server, "/reward", max_retries=0)})
    columns = {**COLUMNS, "ground_truth": ["4", "FAIL", "6", None]}
    result = runner.judge(PROMPTS, COMPLETIONS, IDS, columns)
    assert result.per_judger["remote"] == [1.0, None, 1.0, None]  # both None: one failed, one "not applicable"
    assert result.failed == [(), ("remote",), (), ()] and result.metrics["judger/failures"] == 1.0


def test_batch_mode_one_request(server):
    runner = JudgerRunner({"*": remote(server, "/batch", batch=True, name="rm")})
    result = runner.judge(PROMPTS[:3], COMPLETIONS[:3], IDS[:3], {k: v[:3] for k, v in COLUMNS.items()})
    assert result.per_judger["rm"] == [1.0, 0.0, 1.0] and "rewards/rm/mean" in result.metrics
    assert server.count("/batch") == 1
    _, body = server.requests[0]
    assert body["completions"] == ["is 4", "is 5", "is 6"] and body["ground_truth"] == ["4", "4", "6"]


def test_a_500_is_retried_a_bounded_number_of_times_then_none_and_counted(server, caplog):
    runner = JudgerRunner({"*": [remote(server, "/500", max_retries=2), "tests.helpers.reward_helpers:reward_len"]})
    with caplog.at_level(logging.WARNING):
        result = runner.judge(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert server.count("/500") == 4 * 3  # 1 try + 2 retries per sample, then it gives up
    assert result.per_judger["remote"] == [None] * 4
    assert result.metrics["judger/failures"] == 4.0 and result.failed == [("remote",)] * 4
    assert result.per_judger["reward_len"] == [-0.1] * 4 and result.rewards == [-0.1] * 4  # the run goes on
    logged = [r for r in caplog.records if "HTTP 500" in r.getMessage()]
    assert len(logged) == 1 and "after 3 attempt(s)" in logged[0].getMessage()


def test_a_hanging_server_times_out(server):
    runner = JudgerRunner({"*": remote(server, "/hang", timeout=0.3, max_retries=1)}, timeout=30)
    t0 = time.perf_counter()
    result = runner.judge(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    wall = time.perf_counter() - t0
    assert result.per_judger["remote"] == [None] * 4 and result.metrics["judger/failures"] == 4.0
    assert server.count("/hang") == 4 * 2
    assert wall < 5.0  # 4 samples in parallel, 2 attempts of 0.3 s each; not the server's 20 s


def test_the_runner_timeout_bounds_a_slow_remote_judger(server):
    runner = JudgerRunner({"*": remote(server, "/hang", timeout=10, max_retries=0)}, timeout=0.5)
    t0 = time.perf_counter()
    result = runner.judge(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert time.perf_counter() - t0 < 5.0
    assert result.per_judger["remote"] == [None] * 4 and result.metrics["judger/failures"] == 4.0


def test_client_errors_are_not_retried_but_server_hiccups_are(server):
    runner = JudgerRunner({"*": remote(server, "/404")})
    assert runner.judge(PROMPTS, COMPLETIONS, IDS, COLUMNS).metrics["judger/failures"] == 4.0
    assert server.count("/404") == 4  # a 404 will not get better: no retries
    flaky = RemoteJudger(server.url + "/flaky", timeout=0.5, max_retries=1, backoff=0.0)
    assert flaky(prompts=PROMPTS[:1], completions=COMPLETIONS[:1], ground_truth=["4"]) == [1.0]
    assert server.count("/flaky") == 2 and flaky.consume_failures() == 0


def test_bad_answers_and_unreachable_servers_fail_cleanly(server):
    judger = RemoteJudger(server.url + "/notjson", timeout=0.5, max_retries=0)
    assert judger(prompts=PROMPTS[:2], completions=COMPLETIONS[:2], ground_truth=["4", "4"]) == [None, None]
    assert judger.consume_failures() == 2 and judger.consume_failures() == 0
    short = RemoteJudger(server.url + "/shortbatch", batch=True, timeout=0.5)
    with pytest.raises(RemoteJudgerError, match="list of 2 rewards"):
        short(prompts=PROMPTS[:2], completions=COMPLETIONS[:2], ground_truth=["4", "4"])
    runner = JudgerRunner({"*": remote(server, "/shortbatch", batch=True)})  # in the runner: a counted failure
    result = runner.judge(PROMPTS[:2], COMPLETIONS[:2], IDS[:2], {"data_source": ["s", "s"]})
    assert result.metrics["judger/failures"] == 2
    gone = RemoteJudger(server.url + "/reward", timeout=0.5, max_retries=1, backoff=0.0)
    server.close()  # nothing listens on the port any more: connection refused, retried, then None
    assert gone(prompts=PROMPTS[:1], completions=COMPLETIONS[:1], ground_truth=["4"]) == [None]
    assert gone.consume_failures() == 1
    with pytest.raises(ValueError, match="must start with http"):
        RemoteJudger("127.0.0.1:8000")


def test_secrets_come_from_the_environment_and_stay_out_of_messages(server, caplog, monkeypatch):
    monkeypatch.setenv("REWARD_API_AUTH", "Bearer HEADERSECRET")
    url = server.url.replace("http://", "http://user:PASSWORD@") + "/500?api_key=QUERYSECRET&v=2"
    spec = remote(server, "", max_retries=0, headers_from_env={"Authorization": "REWARD_API_AUTH"})
    spec["init_args"]["url"] = url
    runner = JudgerRunner({"*": [spec]})
    with caplog.at_level(logging.WARNING):
        result = runner.judge(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert result.per_judger["remote"] == [None] * 4 and server.auth == ["Bearer HEADERSECRET"] * 4
    assert server.requests[0][0] == "/500?api_key=QUERYSECRET&v=2"  # the service still gets the query
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "HTTP 500" in text and "/500?api_key=***&v=***" in text
    for secret in ("HEADERSECRET", "QUERYSECRET", "PASSWORD"):
        assert secret not in text
    assert "the user:password in its url will be saved" in text  # warned about, never shown


def test_a_missing_secret_variable_and_a_saved_secret_header(server, caplog, monkeypatch):
    monkeypatch.delenv("REWARD_API_AUTH", raising=False)
    with pytest.raises(Exception, match="reads headers_from_env from REWARD_API_AUTH, which is not set"):
        RemoteJudger(server.url + "/x", headers_from_env={"Authorization": "REWARD_API_AUTH"})
    with caplog.at_level(logging.WARNING):
        RemoteJudger(server.url + "/x", headers={"Authorization": "Bearer HEADERSECRET", "X-Trace": "1"})
    warned = [r.getMessage() for r in caplog.records if "saved with the run's config" in r.getMessage()]
    assert len(warned) == 1 and "Authorization" in warned[0] and "HEADERSECRET" not in warned[0]
