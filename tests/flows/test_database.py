"""`kiln up --database postgres` refuses what it cannot do before it starts anything: a database URL
given beside it, and (as root, where PostgreSQL runs as its own account) a work dir that account
cannot enter; a server that dies while starting is reported with the end of its log. The real cluster is started in tests/flows/test_servers.py and benchmarks/load.py."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.errors import KilnError


def test_the_database_and_urls_are_one_or_the_other(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert main(["up", f"work_dir={tmp_path}", "--database", "postgres",
                 "--mlflow-database", "postgresql://team@db.example/mlflow"]) == 2
    assert "give one or the other" in capsys.readouterr().err
    assert not (tmp_path / "servers" / "postgres").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user than root, PostgreSQL runs as that user")
def test_as_root_a_work_dir_postgres_cannot_reach_is_refused_naming_the_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = Path(tempfile.mkdtemp(prefix="kiln-database-"))  # enterable by all (pytest's folders are root's only)
    try:
        os.chmod(root, 0o711)
        private = root / "private"
        private.mkdir(mode=0o700)
        assert main(["up", f"work_dir={private / 'ops'}", "--database", "postgres"]) == 2
        err = capsys.readouterr().err
        assert f"runs it as the `postgres` account, which cannot enter {private} (mode 700)" in err
        assert f"chmod o+x {private}" in err
        assert not (private / "ops" / "servers" / "postgres").exists()  # nothing half-made left behind
    finally:
        shutil.rmtree(root)


def test_a_server_that_exits_while_starting_is_reported_with_the_end_of_its_log(tmp_path):
    from kiln.flows.servers import Server, _spawn, _wait_healthy, servers_dir

    servers_dir(tmp_path).mkdir(parents=True)
    log = servers_dir(tmp_path) / "mlflow.log"
    dying = _spawn(Server("mlflow", 0, "http://127.0.0.1:9", "", "http://127.0.0.1:9/health", str(log),
                          [sys.executable, "-c", "print('FATAL: could not bind to 127.0.0.1:9'); raise SystemExit(1)"]))
    with pytest.raises(KilnError) as raised:
        _wait_healthy(tmp_path, [dying], timeout_s=60)
    assert str(raised.value) == (f"the mlflow server exited while starting; the end of its log ({log}):\n"
                                 "  FATAL: could not bind to 127.0.0.1:9")
