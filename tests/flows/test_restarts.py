"""`kiln up` restarts what stopped or died as it was, on the real servers (SQLite): after `kiln down` it
comes back on the ports it had, without being told them again (so clients' URLs and the alert links,
which name the Prefect UI's port, stay right); each server SIGKILLed is started again on its port, and
`kiln up` says which, ten times in a row; a server that cannot start shows its own error, not an
earlier server's log.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from kiln.flows.cli import main
from kiln.flows.servers import LOG_MARK, read_servers
from tests.flows.test_operate import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]
KILLS = 10  # per server, in a row (issue 35)


def test_up_restarts_what_stopped_or_died_as_it_was(tmp_path, capsys):
    home = tmp_path / "ops"
    ports = {"prefect": free_port(), "mlflow": free_port()}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        patch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

        def up(*args: str) -> str:
            capsys.readouterr()
            assert main(["up", f"work_dir={home}", *args]) == 0
            return capsys.readouterr().out

        def urls() -> dict[str, str]:
            return {s.name: s.url for s in read_servers(home)}

        try:
            up("--prefect-port", str(ports["prefect"]), "--mlflow-port", str(ports["mlflow"]))
            first = urls()
            assert first == {"prefect": f"http://127.0.0.1:{ports['prefect']}/api",
                             "mlflow": f"http://127.0.0.1:{ports['mlflow']}"}
            assert main(["down", f"work_dir={home}"]) == 0
            said = up()  # no ports: the ones it had
            assert urls() == first and "restarted prefect, mlflow" in said

            def kill(*names: str) -> None:
                pids = [s.pid for s in read_servers(home) if s.name in names]  # all alive: read before killing
                assert len(pids) == len(names)
                for pid in pids:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)  # this process started it: collect it, as `up` would

            for name in ("mlflow", "prefect"):  # one at a time: `up` restarts it alone
                kill(name)
                said = up()
                assert f"restarted {name} (it had stopped or died)" in said
                assert urls() == first
            for _ in range(KILLS - 1):  # then both at once (they start side by side): KILLS kills of each
                kill("mlflow", "prefect")
                said = up()
                assert "restarted prefect, mlflow (they had stopped or died)" in said
                assert urls() == first

            kill("mlflow")  # a server that cannot start: its port taken while it was dead
            with socket.socket() as squatter:
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                bind_when_free(squatter, ports["mlflow"])
                squatter.listen()
                capsys.readouterr()
                assert main(["up", f"work_dir={home}"]) == 2
            message = capsys.readouterr().err
            assert "the mlflow server exited while starting" in message
            assert "in use" in message.lower(), message  # the new server's own reason
            assert LOG_MARK not in message and "GET /health" not in message  # not the earlier servers' log
        finally:
            main(["down", f"work_dir={home}"])


def bind_when_free(sock: socket.socket, port: int, wait_s: float = 20.0) -> None:
    """Bind `port` once the killed server's last worker has let go of it: SIGKILL to its group returns
    before every process in it has closed its sockets."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.bind(("127.0.0.1", port))
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
