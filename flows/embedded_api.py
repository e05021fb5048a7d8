"""The run's own Prefect API (SQLite in PREFECT_HOME), started the moment the CLI knows it needs one.

Without a configured server Prefect starts a temporary API itself, but only at the first flow
call, after Kiln has imported torch, MLflow and the stages, and it first imports the whole server
application into the CLI's process (~3 s) to do so. Starting the same server (the same uvicorn
command and settings Prefect uses) as the CLI's first act lets its start-up overlap the CLI's
imports: a fully cached rerun is dominated by exactly these fixed costs. The child is stopped at
exit and, on Linux, dies with its parent.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kiln.tasks.errors import KilnError

_SERVER: subprocess.Popen | None = None
_URL: str | None = None
_STARTUP_FAILED = 3  # uvicorn's exit code when the app's start-up fails
_MAX_RESTARTS = 3


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def reserve() -> None:
    """Pick the API's port and set PREFECT_API_URL, before Prefect is imported (its settings read it once)."""
    global _URL
    if _URL is None:
        _URL = f"http://127.0.0.1:{_free_port()}/api"
        os.environ["PREFECT_API_URL"] = _URL


def start() -> None:
    """Start the API at the reserved address in the background (no-op if already started)."""
    global _SERVER
    if _SERVER is not None:
        return
    reserve()
    _SERVER = _spawn()
    atexit.register(stop)


def _spawn() -> subprocess.Popen:
    prefect_parent = Path(importlib.util.find_spec("prefect").origin).parent.parent
    port = _URL.rsplit(":", 1)[1].split("/")[0]
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL")  # the server must not think of itself as a client of another
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", port,
         "--log-level", "error", "--lifespan", "on"],
        env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
    )


def wait_until_ready() -> None:
    """Block until the API started by `start` answers its health check."""
    global _SERVER
    if _SERVER is None or _URL is None:
        return
    timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    restarts = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{_URL}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if _SERVER.poll() == _STARTUP_FAILED and restarts < _MAX_RESTARTS:
            # two runs starting at once on a new database race to seed it (a unique-constraint error
            # at start-up); the loser starts again, as Prefect's own temporary server does
            restarts += 1
            _SERVER = _spawn()
        elif _SERVER.poll() is not None:
            raise KilnError(f"the embedded Prefect API exited with code {_SERVER.returncode} while starting; "
                            "run with log_level=DEBUG, or start a server with `kiln up`")
        if time.monotonic() > deadline:
            raise KilnError(f"the embedded Prefect API was not ready after {timeout_s:.0f}s; raise "
                            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS or start a server with `kiln up`")
        time.sleep(0.1)


def stop() -> None:
    global _SERVER, _URL
    if _SERVER is None:
        return
    _SERVER.terminate()
    try:
        _SERVER.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _SERVER.kill()
        _SERVER.wait()
    if os.environ.get("PREFECT_API_URL") == _URL:
        del os.environ["PREFECT_API_URL"]
    _SERVER, _URL = None, None
