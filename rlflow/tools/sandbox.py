"""The built-in ``python`` tool: model-written Python, run in a bubblewrap sandbox.

Named ``python`` in ``data.multiturn.tools`` (the defaults), or ``{class_path: python, init_args: {...}}`` with
:class:`PythonTool`'s settings. Each call runs the code in a fresh ``python -I`` (isolated mode: no user
site-packages, no ``PYTHON*`` variables) inside a sandbox made with bubblewrap (``bwrap``; ``apt-get install
bubblewrap``, which ``tools/setup_env.sh`` does where it can). What the sandbox promises:

* **No network.** A network namespace of its own, with only a loopback interface.
* **A read-only view of the files, except a scratch directory.** The code sees the system directories (``/usr``,
  ``/bin``, ``/lib*``, the dynamic loader's files in ``/etc``) and Python's installation (``sys.prefix`` and
  ``sys.base_prefix``, site-packages included), all read-only, and nothing else of the machine: no home or project
  directory, no ``/etc/shadow``, not the host's ``/tmp``. Its working directory, ``/tmp``, is an empty tmpfs of
  ``scratch`` bytes (64 MiB), gone when the call ends (with bubblewrap older than 0.8, which cannot size a tmpfs:
  a fresh directory on the host's temporary disk, deleted afterwards). Where Python's installation lies under the
  host's ``/tmp`` (a virtual environment made there), it is bound read-only at its own path inside that scratch,
  which then holds its directories too.
* **No privileges.** Under a trainer running as root, the code runs as a random unprivileged user id of its own
  (between 2**30 and 2**31), without capabilities, so files only root may read stay unreadable. Under another
  user, as that user inside a user namespace, without capabilities.
* **No signal to the trainer.** A PID namespace of its own (the code sees only its own processes;
  ``os.getppid()`` is the namespace's init, which ignores it), its own IPC and UTS namespaces and session.
* **Limits**, set before the code is compiled: per process ``RLIMIT_AS`` (``memory``, 512 MiB), ``RLIMIT_CPU``
  (the timeout, rounded up, plus a second), ``RLIMIT_FSIZE`` (16 MiB), no core files; ``RLIMIT_NPROC``: at most
  ``max_processes`` (8) processes and threads at once, counted for this sandbox alone (its own user id or user
  namespace), so a fork bomb stops there. Together its processes hold at most ``max_processes × memory`` of
  address space (4 GiB with the defaults): a bound, not one shared budget, which would need a cgroup.
* **Nothing outlives the call.** At ``timeout`` seconds, or when the tool call's ``data.multiturn.tool_timeout``
  ends (:func:`rlflow.tools.base.time_left`), whichever comes first, the sandbox's process group is killed, and
  with bubblewrap's ``--die-with-parent`` the PID namespace goes too: every process the code started, detached
  (``setsid``, double fork) or not, is killed. When the code ends on its own, whatever it left running is killed.
* **Bounded output.** stdout, then stderr, each written to a file of at most 16 MiB, returned up to
  ``max_output`` characters (the rest cut, saying how much), with a line naming a non-zero exit or the kill.

What it does not promise: it is not a virtual machine. The code runs on the host's kernel (a kernel bug is an
escape), uses CPU and memory up to the limits above, and reads whatever is in its view (the Python installation).
Use gVisor, Firecracker or a VM for hostile code at scale.

Where bubblewrap cannot run (not installed, or namespaces not permitted, as under Docker's default seccomp
profile) the tool refuses to start, with one line, unless the user opts in by name with ``init_args:
{allow_unsandboxed: true}``: then the code runs as a plain child process (``python -I`` in an empty temporary
directory, only a few variables set, the limits above except ``RLIMIT_NPROC``, its process group killed at the
deadline), **without isolation**: as the trainer's user, with that user's files, the network, and the power to
signal the trainer. For trusted code only.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from rlflow.config_checks import at_least, check_values, greater_than
from rlflow.config_error import ConfigError
from rlflow.tools.base import time_left, truncate

log = logging.getLogger(__name__)

MEMORY_BYTES = 512 * 1024 * 1024
FILE_BYTES = 16 * 1024 * 1024
SCRATCH_BYTES = 64 * 1024 * 1024
MAX_PROCESSES = 8
#: What the sandbox sees of the machine besides Python's installation (those that exist here), read-only.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime")
#: The user ids a root trainer's sandboxes run as: one drawn per call, used by nothing else.
SANDBOX_UIDS = (2**30, 2**31)

# The child sets its limits, and under a root trainer drops to its own user id, before it compiles the user's
# code (no preexec_fn, which is unsafe in a threaded parent such as the tool runner). A limit of -1 is left
# alone. argv = [cpu, memory, file size, processes, uid, code].
_BOOT = (
    "import os, resource, signal, sys\n"
    "cpu, mem, fsize, nproc, uid = (int(a) for a in sys.argv[1:6])\n"
    "code = sys.argv[6]\n"
    "for limit, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),\n"
    "                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):\n"
    "    if value >= 0:\n"
    "        resource.setrlimit(limit, (value, value))\n"
    "if uid >= 0:\n"
    "    os.setgroups([])\n"
    "    os.setgid(uid)\n"
    "    os.setuid(uid)\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"  # a write past the file limit fails, it does not kill
    "del sys.argv[1:]\n"
    "exec(compile(code, '<sandbox>', 'exec'), {'__name__': '__main__'})\n"
)
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_lock = threading.Lock()
_found: tuple[str | None, bool, str | None] | None = None  # (bwrap, sizes its tmpfs, why it cannot sandbox)
_warned = False


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start on this machine (the message says why)."""


def _ancestors(path: str) -> list[str]:
    """``path`` and each directory above it, up to the root."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def _view() -> list[str]:
    """The bubblewrap options of the sandbox's read-only view: each path bound at its own place, parents first; a
    symbolic link is recreated as one (unless its place is bound already), and its target is bound too."""
    wanted = [*SYSTEM_PATHS, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable))]
    links, paths = {}, set()
    for path in map(os.path.abspath, wanted):
        if os.path.islink(path):
            links[path] = os.readlink(path)
            path = os.path.realpath(path)
        if os.path.exists(path):
            paths.add(path)
    bound: list[str] = []

    def inside(path: str) -> bool:
        return any(path.startswith(parent.rstrip(os.sep) + os.sep) for parent in bound)

    for path in sorted(paths, key=lambda p: (p.count(os.sep), p)):
        if not inside(path):
            bound.append(path)
    # bubblewrap makes the parents of a mount point 0700, which the sandbox's own user could not pass through
    parents = sorted({p for path in bound for p in _ancestors(os.path.dirname(path))} - {os.sep})
    argv = [arg for path in parents for arg in ("--dir", path)]
    argv += [arg for path in bound for arg in ("--ro-bind", path, path)]
    return argv + [arg for path, target in sorted(links.items()) if not inside(path)
                   for arg in ("--symlink", target, path)]


def _bwrap_argv(exe: str, scratch_dir: str | None, scratch: int) -> list[str]:
    """bubblewrap's command line; the scratch ``/tmp`` is a tmpfs of ``scratch`` bytes, or ``scratch_dir`` bound
    there (bubblewrap before 0.8 cannot size a tmpfs). The scratch is mounted before the read-only view, so that a
    Python installation under the host's ``/tmp`` (a virtual environment made there) is bound on top of it, still
    read-only, instead of being hidden by it."""
    argv = [exe, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
    if scratch_dir is None:
        argv += ["--perms", "1777", "--size", str(scratch), "--tmpfs", "/tmp"]
    else:
        argv += ["--bind", scratch_dir, "/tmp"]
    return argv + _view() + ["--remount-ro", "/", "--chdir", "/tmp"]


def _launch(code: str, wall: float, memory: int, max_processes: int, max_output: int, scratch: int,
            bwrap: str | None, sized: bool = True) -> str:
    """Run ``code`` for at most ``wall`` seconds, in a sandbox made with ``bwrap`` (None: unsandboxed, no
    isolation); its output and status line."""
    sandbox = bwrap is not None
    cpu = max(1, math.ceil(wall)) + 1  # the wall clock normally ends it first
    uid = secrets.randbelow(SANDBOX_UIDS[1] - SANDBOX_UIDS[0]) + SANDBOX_UIDS[0] if sandbox and os.geteuid() == 0 \
        else -1  # drawn from the OS, not from ``random``, whose seeded state belongs to the run
    nproc = max_processes if sandbox else -1  # unsandboxed, the count would include every process of the user
    host_dir = None if sandbox and sized else tempfile.mkdtemp(prefix="rlflow-sandbox-")
    if bwrap is not None:
        if host_dir is not None:
            os.chmod(host_dir, 0o1777)  # the sandbox's own user writes there
        prefix, env, cwd = _bwrap_argv(bwrap, host_dir, scratch), {**_ENV, "HOME": "/tmp"}, "/"
    else:
        prefix, env, cwd = [], {**_ENV, "HOME": host_dir, "TMPDIR": host_dir}, host_dir
    cmd = [*prefix, sys.executable, "-I", "-c", _BOOT, str(cpu), str(memory), str(FILE_BYTES), str(nproc), str(uid),
           code]
    try:
        with tempfile.TemporaryFile("a+b") as out, tempfile.TemporaryFile("a+b") as err:
            # files, not pipes: a process the code leaves behind cannot hold this call open, the file size limit
            # bounds what it writes, and appending keeps every process's lines
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                code_ = proc.wait(timeout=wall)
                if code_ in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
                    status = f"\n[killed: CPU time limit of {cpu} s]"
                else:
                    status = "" if code_ == 0 else f"\n[exit status {code_}]"
            except subprocess.TimeoutExpired:
                status = f"\n[killed: timed out after {round(wall, 2)} s]"
            finally:  # the whole group (with bwrap: its PID namespace too), also whatever outlived the code
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            out.seek(0)
            err.seek(0)
            text = out.read().decode(errors="replace") + err.read().decode(errors="replace")
    finally:
        if host_dir is not None:
            shutil.rmtree(host_dir, ignore_errors=True)
    return truncate(text, max_output) + status


def _bubblewrap() -> tuple[str | None, bool, str | None]:
    """``(bwrap's path, whether it sizes a tmpfs, why it cannot sandbox here or None)``, found once per process by
    running a sandbox for real."""
    global _found
    with _lock:
        if _found is None:
            exe = shutil.which("bwrap")
            if exe is None:
                _found = (None, False, "bubblewrap (bwrap) is not installed")
            else:
                try:
                    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
                    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
                    sized = numbers >= (0, 8)
                    out = _launch("print('ok')", 30.0, MEMORY_BYTES, MAX_PROCESSES, 2000, SCRATCH_BYTES, exe, sized)
                    problem = None if out == "ok\n" else f"a test sandbox failed: {' '.join(out.split())[-300:]}"
                except (OSError, subprocess.SubprocessError) as exc:
                    sized, problem = False, f"a test sandbox failed: {exc}"
                _found = (exe, sized, problem)
        return _found


def sandbox_problem() -> str | None:
    """Why the python tool cannot sandbox code on this machine (bubblewrap missing, or its error when it tried);
    None when it can. Found once per process."""
    return _bubblewrap()[2]


def run_python(code: str, timeout: float = 10.0, memory: int = MEMORY_BYTES, max_output: int = 2000,
               max_processes: int = MAX_PROCESSES, scratch: int = SCRATCH_BYTES, sandbox: bool = True) -> str:
    """Run ``code`` (in the sandbox unless ``sandbox`` is False) for at most ``timeout`` seconds, or what is left of
    the tool call running it; its stdout, then stderr, truncated, and a line naming a non-zero exit or the kill.
    :class:`SandboxUnavailable` where the sandbox cannot start."""
    left = time_left()
    wall = timeout if left is None else min(timeout, left)
    if wall <= 0:
        return "[not run: the tool call had no time left]"
    if not sandbox:
        return _launch(code, wall, memory, max_processes, max_output, scratch, None)
    exe, sized, problem = _bubblewrap()
    if problem is not None:
        raise SandboxUnavailable(f"the python tool's sandbox cannot start: {problem}")
    return _launch(code, wall, memory, max_processes, max_output, scratch, exe, sized)


class PythonTool:
    """The ``python`` tool: runs the model's code in the sandbox this module describes, and returns its output.

    Args:
        timeout: Seconds one program may run; the tool call's ``data.multiturn.tool_timeout`` ends it sooner.
        memory: Bytes of address space of each process (``RLIMIT_AS``).
        max_processes: Processes and threads the program may run at once (``RLIMIT_NPROC``, sandboxed only).
        max_output: Characters of output returned; the rest is cut, saying how much.
        scratch: Bytes of the scratch directory (the working directory, ``/tmp``).
        allow_unsandboxed: Where bubblewrap cannot run, run the code anyway, as a plain child process **without
            isolation** (it reads and writes what the trainer's user can, uses the network, can signal the
            trainer). Off, the tool refuses to start there, with one line saying why.
    """

    name = "python"

    def __init__(self, timeout: float = 10.0, memory: int = MEMORY_BYTES, max_processes: int = MAX_PROCESSES,
                 max_output: int = 2000, scratch: int = SCRATCH_BYTES, allow_unsandboxed: bool = False) -> None:
        check_values("data.multiturn.tools: python", {
            "timeout": greater_than(0.0), "memory": at_least(32 * 2**20), "max_processes": at_least(1),
            "max_output": at_least(1), "scratch": at_least(2**20),
        }, {"timeout": timeout, "memory": memory, "max_processes": max_processes, "max_output": max_output,
            "scratch": scratch})
        self.timeout, self.memory, self.max_processes = float(timeout), int(memory), int(max_processes)
        self.max_output, self.scratch = int(max_output), int(scratch)
        problem = sandbox_problem()
        if problem is not None and not allow_unsandboxed:
            raise ConfigError(
                f"data.multiturn.tools: the python tool runs model-written code only in a bubblewrap sandbox, and "
                f"none can start here ({problem}): install bubblewrap (apt-get install bubblewrap), or run the code "
                "without isolation, as this user with its files and network, by naming it: "
                "{class_path: python, init_args: {allow_unsandboxed: true}}"
            )
        if problem is not None:
            global _warned
            if not _warned:
                _warned = True
                log.warning("the python tool runs model-written code WITHOUT a sandbox (allow_unsandboxed: %s): it "
                            "can read and write this user's files, use the network and signal the trainer", problem)
        self.sandbox = problem is None

    def __call__(self, code: str) -> str:
        """Run Python code in a sandbox and return what it printed.

        Args:
            code: A Python program; print the values you need, e.g. "print(123 * 456)".
        """
        return run_python(code, self.timeout, self.memory, self.max_output, self.max_processes, self.scratch,
                          self.sandbox)


#: The ``python`` entry point of the ``rlflow.tools`` group.
python = PythonTool
