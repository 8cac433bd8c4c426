"""The ``remote`` judger against hostile servers on 127.0.0.1: one that drips its answer a byte at a time, one that
redirects to another origin, none at all, and a run that ends while a request hangs. Every server stops on its own
within seconds, so a test that fails still ends."""

from __future__ import annotations

import json
import socket
import socketserver
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlflow.config_error import ConfigError
from rlflow.judgers.remote import RemoteJudger
from rlflow.judgers.runner import JudgerRunner

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["q0", "q1"]
COMPLETIONS = ["a0", "a1"]


class Server:
    """A TCP server on a free 127.0.0.1 port whose ``respond(handler, request_text)`` writes raw bytes; every
    request's text is recorded. Connections end with the server, at the latest after ``lifetime`` seconds."""

    def __init__(self, respond, lifetime: float = 10.0) -> None:
        self.requests: list[str] = []
        self.stop = threading.Event()
        self.lifetime = lifetime
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = self.request.recv(65536)
                        if not chunk:  # a connection without a request (the judger's check at start-up)
                            return
                        data += chunk
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    while len(body) < length:
                        body += self.request.recv(65536) or b" " * length
                    server.requests.append((head + b"\r\n\r\n" + body).decode(errors="replace"))
                    respond(self, server)
                except OSError:
                    pass

            def send(self, data: bytes) -> None:
                self.request.sendall(data)

        self.tcp = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.tcp.daemon_threads = True
        self.port = self.tcp.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/reward"
        threading.Thread(target=self.tcp.serve_forever, daemon=True).start()

    def drip(self, handler, data: bytes, every: float = 0.2) -> None:
        """Send ``data`` a byte every ``every`` seconds, until it is sent, the server stops or its lifetime ends."""
        end = time.monotonic() + self.lifetime
        for byte in data:
            if self.stop.wait(every) or time.monotonic() > end:
                return
            handler.send(bytes([byte]))

    def close(self) -> None:
        self.stop.set()
        self.tcp.shutdown()
        self.tcp.server_close()


def answer(status: str, payload, **headers) -> bytes:
    body = json.dumps(payload).encode()
    lines = [f"HTTP/1.1 {status}", "Content-Type: application/json", f"Content-Length: {len(body)}",
             "Connection: close", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(respond, lifetime: float = 10.0) -> Server:
        started.append(Server(respond, lifetime))
        return started[-1]

    yield start
    for server in started:
        server.close()


REWARD = answer("200 OK", {"reward": 1.0})


@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_server_dripping_a_byte_at_a_time_is_cut_off_at_the_total_deadline(servers, where):
    def respond(handler, server):
        if where == "body":  # the headers at once, then the body a byte every 0.2 s
            head, _, body = REWARD.partition(b"\r\n\r\n")
            handler.send(head + b"\r\n\r\n")
            server.drip(handler, body)
        else:
            server.drip(handler, REWARD)

    server = servers(respond)
    judger = RemoteJudger(server.url, timeout=1.0, max_retries=1, backoff=0.0)
    t0 = time.monotonic()
    rewards = judger(prompts=PROMPTS, completions=COMPLETIONS)
    wall = time.monotonic() - t0
    assert rewards == [None, None] and judger.consume_failures() == 2
    assert wall < 4.0, f"a 1 s deadline (2 attempts) took {wall:.1f} s: the drip reset the timeout at each byte"
    assert len(server.requests) == 4  # 2 samples x (1 try + 1 retry)


def test_a_redirect_to_another_origin_is_not_followed_and_its_reward_not_taken(servers, caplog):
    def elsewhere(handler, server):
        handler.send(REWARD)

    other = servers(elsewhere)

    def redirect(status):
        def respond(handler, server):
            handler.send(answer(status, {}, Location=other.url))
        return respond

    for status in ("302 Found", "307 Temporary Redirect", "308 Permanent Redirect"):
        server = servers(redirect(status))
        judger = RemoteJudger(server.url, timeout=2.0, max_retries=2, backoff=0.0,
                              headers={"Authorization": "Bearer s3cret"})
        assert judger(prompts=PROMPTS[:1], completions=COMPLETIONS[:1]) == [None], status
        assert judger.consume_failures() == 1
        assert other.requests == [], f"{status}: the request (with its Authorization header) reached another host"
        assert len(server.requests) == 1  # a redirect will not get better: not retried
    assert f"redirecting to {other.url}" in caplog.text and "Bearer" not in caplog.text


def test_a_redirect_on_the_same_origin_that_keeps_the_body_is_followed(servers):
    def respond(handler, server):
        if "POST /reward " in server.requests[-1]:
            handler.send(answer("307 Temporary Redirect", {}, Location="/reward/"))
        else:
            handler.send(answer("200 OK", {"reward": json.loads(server.requests[-1].split("\r\n\r\n")[1])["n"]}))

    server = servers(respond)
    judger = RemoteJudger(server.url, timeout=2.0, headers={"Authorization": "Bearer s3cret"})
    assert judger.post({"n": 0.5}) == {"reward": 0.5}
    followed = server.requests[1]
    assert followed.startswith("POST /reward/ ") and "Authorization: Bearer s3cret" in followed


def test_an_unreachable_server_fails_at_startup_with_one_line():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/reward"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as direct:
        RemoteJudger(url, timeout=30)
    assert time.monotonic() - t0 < 5
    message = str(direct.value)
    assert "\n" not in message and url in message and "cannot reach" in message
    with pytest.raises(ConfigError, match="cannot reach"):  # as a run builds it
        JudgerRunner({"*": {"class_path": "remote", "init_args": {"url": url}}})


def test_no_request_outlives_the_run(servers):
    def respond(handler, server):  # answers nothing for the server's lifetime
        server.stop.wait(server.lifetime)

    server = servers(respond, lifetime=30.0)
    # a run that judged with a hung server (the runner gives up at its timeout) and then ends, as after training
    run = textwrap.dedent(f"""
        from rlflow.judgers.runner import JudgerRunner
        spec = {{"class_path": "remote", "init_args": {{"url": {server.url!r}, "timeout": 60, "max_retries": 0}}}}
        runner = JudgerRunner({{"*": spec}}, timeout=1.0)
        result = runner.judge(["q"], ["a"], [[1]], {{"data_source": ["s"]}})
        print("judged", result.per_judger["remote"], flush=True)
        """)
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", run], cwd=ROOT, capture_output=True, text=True, timeout=25)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit after its run ended: a request kept it alive ({exc.stdout!r})")
    assert done.returncode == 0 and "judged [None]" in done.stdout, done.stderr
    assert time.monotonic() - t0 < 25
