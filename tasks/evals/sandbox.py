"""Runs model-written Python against its unit tests in a sandboxed subprocess (the coding tasks' pass@1).

Generated code is untrusted: it may loop forever, allocate without bound, open sockets or write
anywhere. Each program runs in a child process that:

- starts in a fresh scratch folder (its working directory and `TMPDIR`), removed afterwards;
- has resource limits set before any of its code runs: CPU seconds (`RLIMIT_CPU`), address space
  (`RLIMIT_AS`), the size of a file it writes (`RLIMIT_FSIZE`) and no core dumps;
- has no network: where `unshare` can give it its own (empty) network namespace it runs in one, and
  in any case an audit hook, installed before the program runs and impossible to remove from Python,
  refuses socket creation, opening a file for writing outside the scratch folder, starting processes
  and loading native code through ctypes;
- is killed with its whole process group when it runs past a wall-clock timeout.

A program passes when it exits with status 0 (every `assert` of its tests held). Anything else, a
failure, an exception, a limit hit or a timeout, is a fail with the reason; the caller goes on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pydantic import Field

from kiln.tasks.configbase import Section

PROGRAM = "program.py"
# Runs in the child before the program: limits, then the audit hook, then the program itself.
_BOOTSTRAP = r"""
import os, resource, sys
cpu, memory, fsize = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
root = os.path.realpath(os.getcwd())
_DENIED = {"socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "os.system", "os.exec",
           "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen", "ctypes.dlopen", "pty.spawn"}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
def _inside(path):
    return os.path.realpath(path) == root or os.path.realpath(path).startswith(root + os.sep)
def _hook(event, args):
    if event in _DENIED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "r", args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or flags & _WRITE
        if writes and not _inside(os.fsdecode(args[0])):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the scratch folder")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "shutil.rmtree", "os.truncate",
                 "os.symlink", "os.link", "os.replace"):
        paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
        if any(not _inside(os.fsdecode(p)) for p in paths):
            raise PermissionError(f"sandbox: {event} outside the scratch folder")
sys.addaudithook(_hook)
import runpy
runpy.run_path(sys.argv[4], run_name="__main__")
"""


class SandboxConfig(Section):
    """Limits of one executed program (a generated solution and its tests)."""

    cpu_seconds: int = Field(5, ge=1)
    memory_mb: int = Field(512, ge=64)  # address space, which includes the interpreter (~30 MB)
    file_mb: int = Field(8, ge=1)  # the largest file it may write
    wall_seconds: float = Field(10.0, gt=0)  # killed, with its process group, past this


@dataclass(frozen=True)
class Execution:
    passed: bool
    reason: str  # "passed", "timeout", "exit status N: <last line of stderr>"


@cache
def network_namespace_available() -> bool:
    """Whether `unshare` can put a child into a network namespace of its own (needs user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--user", "--net", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_program(source: str, limits: SandboxConfig) -> Execution:
    """Run `source` (a solution followed by its asserts) in the sandbox; whether it passed and why not."""
    with tempfile.TemporaryDirectory(prefix="kiln-sandbox-") as scratch:
        Path(scratch, PROGRAM).write_text(source, encoding="utf-8")
        command = [sys.executable, "-I", "-c", _BOOTSTRAP, str(limits.cpu_seconds), str(limits.memory_mb << 20),
                   str(limits.file_mb << 20), PROGRAM]
        if network_namespace_available():
            command = ["unshare", "--user", "--net", "--map-root-user", *command]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TMPDIR": scratch, "HOME": scratch,
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        process = subprocess.Popen(command, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, stderr = process.communicate(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return Execution(False, "timeout")
        finally:
            _kill_group(process)  # anything it left running in its group
    if process.returncode == 0:
        return Execution(True, "passed")
    last = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    status = process.returncode
    what = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    return Execution(False, f"{what}: {last[0][:200]}")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
