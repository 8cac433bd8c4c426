"""The built-in ``python`` tool: run a snippet of Python in a separate, resource-limited process.

What the sandbox does:

* the code runs in a fresh ``python -I`` (isolated mode: no user site-packages, no ``PYTHON*`` variables, the
  script directory not on ``sys.path``) child process, in its own session and an empty temporary working
  directory that is deleted afterwards, with an environment of only ``PATH``;
* limits (``setrlimit`` in the child before the code is compiled): address space ``RLIMIT_AS`` (512 MiB), CPU time
  ``RLIMIT_CPU`` (the timeout rounded up, plus a second), file size ``RLIMIT_FSIZE`` (16 MiB), no core files; a
  wall-clock timeout kills the whole process group;
* no network: where ``unshare --user --net`` works (Linux with unprivileged user namespaces) the child gets a
  network namespace with no interfaces; :func:`network_isolation_available` says whether it does on this
  machine. Where it does not, **network access is not blocked** (a warning is logged once);
* stdout and stderr are returned, truncated to ``max_output`` characters.

What it does **not** protect against: it is not a security boundary for hostile code. The child runs as the same
user and can read (and write) every file that user can outside its working directory, spawn processes (they share
the CPU limit per process only), and use the network where no namespace is available. Use a container or a VM
(gVisor, Firecracker) for untrusted code at scale; this tool is meant for a policy's own arithmetic and small
programs.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

log = logging.getLogger(__name__)

MEMORY_BYTES = 512 * 1024 * 1024
FILE_BYTES = 16 * 1024 * 1024
_network: bool | None = None


def network_isolation_available() -> bool:
    """Whether ``unshare --user --net`` can start a process here (checked once)."""
    global _network
    if _network is None:
        exe = shutil.which("unshare")
        ok = False
        if exe is not None:
            try:
                ok = subprocess.run([exe, "--user", "--net", "true"], capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
        if not ok:
            log.warning("the python tool cannot isolate the network here (`unshare --user --net` is not available): "
                        "sandboxed code can use the network")
        _network = ok
    return _network


# The child sets its own limits before it compiles the user's code (no preexec_fn, which is unsafe in a threaded
# parent such as the tool runner): argv = [limits..., code].
_BOOT = (
    "import resource, sys\n"
    "cpu, mem, fsize, code = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "del sys.argv[1:]\n"
    "exec(compile(code, '<sandbox>', 'exec'), {'__name__': '__main__'})\n"
)


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]"


def run_python(code: str, timeout: float = 10.0, memory: int = MEMORY_BYTES, max_output: int = 2000) -> str:
    """Run ``code`` in the sandbox; its stdout, then stderr, truncated, and a line naming a non-zero exit or the
    timeout."""
    workdir = tempfile.mkdtemp(prefix="rlflow-sandbox-")
    cpu = max(1, int(timeout + 0.999)) + 1  # the wall clock normally ends it first
    cmd = [sys.executable, "-I", "-c", _BOOT, str(cpu), str(memory), str(FILE_BYTES), code]
    if network_isolation_available():
        cmd = [shutil.which("unshare") or "unshare", "--user", "--net", *cmd]
    try:
        proc = subprocess.Popen(cmd, cwd=workdir, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode == -signal.SIGXCPU:
                status = f"\n[killed: CPU time limit of {cpu} s]"
            else:
                status = "" if proc.returncode == 0 else f"\n[exit status {proc.returncode}]"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            status = f"\n[killed: timed out after {timeout} s]"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode(errors="replace") + (err.decode(errors="replace") if err else "")
    return truncate(text, max_output) + status


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: A Python program; print the values you need, e.g. "print(123 * 456)".
    """
    return run_python(code)
