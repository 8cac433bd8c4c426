"""The ``python`` tool against hostile model-written code: every escape the sandbox promises to stop, tried.

Each hostile program is bounded by itself (a fork loop of 200, sleeps of a minute at most), so that even without the
sandbox a test ends in its time; processes are found by a marker in their command line and killed afterwards.
Tests of the sandbox itself skip, saying why, where bubblewrap cannot run here.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rlflow.config_error import ConfigError
from rlflow.tools import sandbox
from rlflow.tools.base import ToolCall, ToolRunner, load_tools
from rlflow.tools.sandbox import PythonTool, run_python, sandbox_problem

ROOT = Path(__file__).resolve().parents[3]
PROBLEM = sandbox_problem()
needs_sandbox = pytest.mark.skipif(PROBLEM is not None, reason=f"bubblewrap cannot run here: {PROBLEM}")
MODES = [pytest.param(True, marks=needs_sandbox, id="sandboxed"), pytest.param(False, id="unsandboxed")]


def installation_in_tmp() -> list[str]:
    """The names in ``/tmp`` under which Python's installation lies (a virtual environment made there), which the
    sandbox binds read-only inside its scratch ``/tmp``; usually none."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                           os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted({Path(p).relative_to("/tmp").parts[0] for p in paths if p.startswith("/tmp/")})


def processes_with(marker: str) -> list[int]:
    """Pids of the processes whose command line holds ``marker`` (the sandboxed code carries it in its argv)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def survivors(marker: str, within: float = 3.0) -> list[int]:
    """The marked processes still alive after ``within`` seconds (killed then, so that a failing test leaves none)."""
    end = time.monotonic() + within
    while (left := processes_with(marker)) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


@pytest.mark.parametrize("sandboxed", MODES)
def test_output_exit_status_timeout_memory_truncation(sandboxed):
    assert run_python("print(6 * 7)", sandbox=sandboxed) == "42\n"
    assert run_python("import sys; sys.exit(3)", sandbox=sandboxed).endswith("[exit status 3]")
    spin = run_python("while True: pass", timeout=1.0, sandbox=sandboxed)
    assert "[killed: timed out after 1.0 s]" in spin or "[killed: CPU time limit of 2 s]" in spin, spin
    assert "MemoryError" in run_python("x = bytearray(1024 ** 3)", memory=256 * 1024 * 1024, sandbox=sandboxed)
    out = run_python("print('a' * 5000)", max_output=100, sandbox=sandboxed)
    assert out.startswith("a" * 100) and "[truncated 4901 characters]" in out
    listed = run_python("import os; print(sorted(os.listdir('.')))", sandbox=sandboxed)
    assert listed == f"{installation_in_tmp() if sandboxed else []}\n"  # empty, but for Python's own installation
    exits = run_python("print('x', flush=True)\nraise SystemExit('bye')", sandbox=sandboxed)
    assert exits == "x\nbye\n\n[exit status 1]"  # stdout, then stderr


@needs_sandbox
def test_no_root_only_file_and_no_file_outside_its_view_can_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    secret.chmod(0o600)
    code = textwrap.dedent(f"""
        import os
        print("uid", os.getuid())
        for path in ["/etc/shadow", {str(secret)!r}, {str(ROOT / "pyproject.toml")!r}, os.path.expanduser("~/.bashrc")]:
            try:
                print(path, open(path).read()[:40])
            except OSError as e:
                print(path, "refused", type(e).__name__)
        """)
    out = run_python(code)
    assert "TOP-SECRET" not in out and "[project]" not in out and "root:" not in out, out
    assert out.count("refused") == 4, out
    if os.geteuid() == 0:  # a root trainer's sandbox runs as an unprivileged user of its own
        assert "uid 0\n" not in out, out


@needs_sandbox
def test_writes_reach_only_the_scratch_directory(tmp_path):
    name = f"rlflow-sandbox-escape-{uuid.uuid4().hex[:8]}"
    targets = [ROOT / name, tmp_path / name, Path(sys.prefix) / name]
    code = textwrap.dedent(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                open(path, "w").write("pwned")
                print("wrote", path)
            except OSError as e:
                print("refused", type(e).__name__)
        open("scratch.txt", "w").write("mine")
        print(open("/tmp/scratch.txt").read())
        """)
    try:
        out = run_python(code)
        assert "wrote" not in out and out.count("refused") == 3 and out.endswith("mine\n"), out
        assert not any(t.exists() for t in targets)
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@needs_sandbox
def test_a_fork_bomb_stops_at_max_processes_and_memory_is_bounded_across_them():
    marker = f"rlflow-forkbomb-{uuid.uuid4().hex[:8]}"
    code = textwrap.dedent(f"""
        import os, time
        # {marker}
        n = 0
        for i in range(200):  # bounded: without limits, 200 sleeping children, 16 of them holding 48 MiB
            try:
                pid = os.fork()
            except OSError as e:
                print("fork refused:", e.strerror)
                break
            if pid == 0:
                if i < 16:
                    try:
                        block = bytearray(48 * 2**20)
                        print("child holds 48 MiB", flush=True)
                    except MemoryError:
                        print("child MemoryError", flush=True)
                time.sleep(60)
                os._exit(0)
            n += 1
        time.sleep(1)
        print("forked", n)
        """)
    try:
        out = run_python(code, timeout=20, memory=96 * 2**20, max_processes=4)
        forked = int(out.split("forked ")[1].split()[0])
        assert "fork refused: Resource temporarily unavailable" in out and forked <= 3, out
        assert out.count("child holds 48 MiB") == forked, out  # so at most max_processes x memory in all
        assert survivors(marker) == []  # the children went with the sandbox
    finally:
        survivors(marker, within=0)


@pytest.mark.parametrize("leaves", ["at the timeout", "when the code ends"])
@needs_sandbox
def test_a_detached_child_does_not_outlive_the_call(leaves):
    marker = f"rlflow-detached-{uuid.uuid4().hex[:8]}"
    code = textwrap.dedent(f"""
        import os, time
        # {marker}
        if os.fork() == 0:  # double fork and a new session: what a daemon does to escape its process group
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        time.sleep({60 if leaves == "at the timeout" else 0.5})
        print("parent done")
        """)
    try:
        t0 = time.monotonic()
        out = run_python(code, timeout=3)
        assert time.monotonic() - t0 < 10
        assert ("timed out after 3" in out) == (leaves == "at the timeout"), out
        assert survivors(marker) == []
    finally:
        survivors(marker, within=0)


@needs_sandbox
def test_the_code_cannot_signal_the_trainer():
    # The "trainer" is a child python in a session of its own running the tool, and the code aims only at it (its
    # pid, its process group, the code's parent): if the sandbox failed, that child would die, not this test run.
    # Never kill(-1, ...) here: outside a sandbox, as root, that is every process of the machine.
    hostile = textwrap.dedent("""
        import os, signal
        for name, send in [("parent", lambda: os.kill(os.getppid(), signal.SIGKILL)),
                           ("trainer", lambda: os.kill(TRAINER, signal.SIGKILL)),
                           ("trainer's group", lambda: os.killpg(TRAINER, signal.SIGKILL))]:
            try:
                send()
                print("sent to", name)
            except OSError as e:
                print("refused", name, type(e).__name__)
        """)
    trainer = textwrap.dedent(f"""
        import os
        from rlflow.tools.sandbox import run_python
        print(run_python({hostile!r}.replace("TRAINER", str(os.getpid()))), flush=True)
        print("trainer alive")
        """)
    done = subprocess.run([sys.executable, "-c", trainer], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          start_new_session=True)
    assert done.returncode == 0 and "trainer alive" in done.stdout, (done.returncode, done.stdout, done.stderr)


@needs_sandbox
def test_no_network_not_even_the_hosts_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as e:
                print("blocked", type(e).__name__)
            """)
        out = run_python(code)
    assert out.startswith("blocked"), out


@pytest.mark.parametrize("sandboxed", MODES)
def test_the_tool_timeout_stops_the_program_instead_of_abandoning_it(sandboxed):
    marker = f"rlflow-runner-deadline-{uuid.uuid4().hex[:8]}"
    tool = PythonTool(timeout=60, allow_unsandboxed=True)
    tool.sandbox = sandboxed
    runner = ToolRunner(load_tools([tool]), timeout=1.0)
    try:
        t0 = time.monotonic()
        (result,) = runner.run([ToolCall("python", {"code": f"import time  # {marker}\ntime.sleep(50)"})])
        assert result.failure == "timeout" and time.monotonic() - t0 < 10
        assert survivors(marker) == []  # ended with the call, not 60 s later
    finally:
        survivors(marker, within=0)


def test_without_bubblewrap_the_tool_refuses_to_start_unless_opted_in_by_name(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_found", (None, False, "bubblewrap (bwrap) is not installed"))
    monkeypatch.setattr(sandbox, "_warned", False)
    with pytest.raises(ConfigError) as refused:
        load_tools(["python"])
    message = str(refused.value)
    assert "\n" not in message and "bubblewrap (bwrap) is not installed" in message
    assert "apt-get install bubblewrap" in message and "allow_unsandboxed: true" in message
    with pytest.raises(sandbox.SandboxUnavailable):
        run_python("print(1)")
    with caplog.at_level(logging.WARNING):
        tools = load_tools([{"class_path": "python", "init_args": {"allow_unsandboxed": True, "timeout": 5}}])
    assert "WITHOUT a sandbox" in caplog.text
    tool = tools["python"]
    assert tool.schema["function"]["name"] == "python" and tool.schema["function"]["parameters"]["required"] == ["code"]
    assert tool.fn.sandbox is False and tool.fn.timeout == 5.0
    assert ToolRunner(tools).run([ToolCall("python", {"code": "print(2 + 2)"})])[0].content == "4\n"


def test_settings_are_checked():
    with pytest.raises(ConfigError, match=r"data.multiturn.tools: python.max_processes must be >= 1, got 0"):
        PythonTool(max_processes=0, allow_unsandboxed=True)


@needs_sandbox
def test_the_python_tool_by_its_short_name_is_sandboxed():
    tools = load_tools(["python"])
    assert tools["python"].fn.sandbox is True
    out = ToolRunner(tools).run([ToolCall("python", {"code": "import os; print(os.getpid())"})])[0].content
    assert int(out) < 10  # its own PID namespace


@pytest.mark.parametrize("scratch_dir", [None, "/var/tmp/rlflow-scratch"])
def test_an_installation_under_tmp_is_bound_over_the_scratch_not_hidden_by_it(monkeypatch, tmp_path, scratch_dir):
    """A virtual environment made under the host's /tmp: the sandbox's own /tmp is mounted first and the
    installation bound read-only on top of it (the other order would hide the interpreter)."""
    venv = Path("/tmp") / f"rlflow-venv-{uuid.uuid4().hex[:8]}"
    venv.mkdir()
    try:
        monkeypatch.setattr(sys, "prefix", str(venv))
        argv = sandbox._bwrap_argv("bwrap", scratch_dir, 1 << 20)
        scratch = argv.index("/tmp", argv.index("--tmpfs" if scratch_dir is None else "--bind"))
        bound = [i for i, arg in enumerate(argv) if arg == "--ro-bind" and argv[i + 1] == str(venv)]
        assert len(bound) == 1 and scratch < bound[0] and argv[bound[0] + 2] == str(venv)
        assert argv.index("--remount-ro") > bound[0] and argv[-2:] == ["--chdir", "/tmp"]
    finally:
        venv.rmdir()
