"""A test that runs past its time limit fails, and its report names what it was waiting for
(tests/timeouts.py): run here as a pytest session of its own on one hung test."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The job and port are local variables, not arguments: pytest shows a frame's arguments anyway.
HUNG = """
import time


def test_a_hung_wait():
    job_id, port = "4242", 45678
    while True:  # a job that never ends
        time.sleep(0.05)
"""


def test_a_hung_test_fails_at_its_limit_and_names_the_job_and_port_it_waited_on(tmp_path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    # only pytest-timeout and the plugin under test (the installed plugins cost seconds to load)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_timeout", "-p", "tests.timeouts",
                           "-p", "no:cacheprovider", "--timeout=1", "test_hung.py"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Failed: Timeout (>1.0s) from pytest-timeout." in done.stdout
    assert re.search(r"job_id\s+= '4242'", done.stdout) and re.search(r"port\s+= 45678", done.stdout), done.stdout
