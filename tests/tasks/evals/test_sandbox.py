"""The coding tasks' sandbox: a passing program passes; one that loops, allocates without bound, opens a
socket, writes outside its folder or starts a process is stopped, fails, and the next one still runs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kiln.tasks.evals.sandbox import SandboxConfig, run_program

LIMITS = SandboxConfig(cpu_seconds=2, memory_mb=256, wall_seconds=4)


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    assert run_program("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n", LIMITS).passed
    wrong = run_program("def add(a, b):\n    return a - b\nassert add(2, 3) == 5\n", LIMITS)
    assert not wrong.passed and "AssertionError" in wrong.reason


def test_a_program_may_write_inside_its_scratch_folder():
    source = "open('out.txt', 'w').write('x')\nimport os\nos.mkdir('sub')\nassert open('out.txt').read() == 'x'\n"
    assert run_program(source, LIMITS).passed


@pytest.mark.parametrize(("name", "source", "why"), [
    # RLIMIT_CPU: SIGXCPU (or SIGKILL past the hard limit); on a loaded machine the wall clock may come first
    ("busy loop", "while True:\n    pass\n", ("signal", "timeout")),
    ("sleeping loop", "import time\nwhile True:\n    time.sleep(1)\n", "timeout"),  # no CPU spent: the wall clock
    ("unbounded allocation", "xs = []\nwhile True:\n    xs.append(bytearray(1 << 24))\n", "MemoryError"),
    ("socket", "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n", "socket.__new__"),
    ("write outside", "open('/tmp/kiln-sandbox-escape.txt', 'w').write('x')\n", "outside the scratch folder"),
    ("write above", "open('../escape.txt', 'w').write('x')\n", "outside the scratch folder"),
    ("subprocess", "import subprocess\nsubprocess.run(['true'])\n", "not allowed"),
    ("os.system", "import os\nos.system('true')\n", "os.system"),
])
def test_a_harmful_program_is_stopped_and_fails(name, source, why):
    started = time.monotonic()
    result = run_program(source, LIMITS)
    assert not result.passed and any(reason in result.reason for reason in ([why] if isinstance(why, str) else why)), result
    assert time.monotonic() - started < LIMITS.wall_seconds + 3
    assert not Path("/tmp/kiln-sandbox-escape.txt").exists()
    # The run goes on: the next program runs and passes.
    assert run_program("assert 1 + 1 == 2\n", LIMITS).passed
