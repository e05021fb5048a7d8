"""`kiln slurm up | status | down`: a real local Slurm cluster started, shown and stopped from the command
line, its one export line on stdout, and a job script accepted by the cluster that line names."""

from __future__ import annotations

import os
import subprocess

import pytest

from kiln.flows.cli import main
from kiln.tasks.launch.local_slurm import LocalSlurmCluster

pytestmark = pytest.mark.cluster


def test_slurm_up_status_down(tmp_path, capsys):
    folder = tmp_path / "slurm"
    try:
        assert main(["slurm", "up", "--work-dir", str(tmp_path), "--cpus", "2"]) == 0
        out, err = capsys.readouterr()
        assert out == f"export SLURM_CONF={folder / 'slurm.conf'}\n"  # the one line: eval "$(kiln slurm up)"
        assert "1 node(s)" in err and "2 CPUs each" in err and "kiln slurm down" in err
        env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
        script = tmp_path / "job.sh"
        script.write_text("#!/bin/bash\n#SBATCH --cpus-per-task=2\ntrue\n")
        tested = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, env=env)
        assert tested.returncode == 0, tested.stderr

        assert main(["slurm", "up", "--work-dir", str(tmp_path)]) == 0  # already up: the same line, not a second one
        out, err = capsys.readouterr()
        assert out == f"export SLURM_CONF={folder / 'slurm.conf'}\n" and "already runs" in err
        assert main(["slurm", "status", f"work_dir={tmp_path}"]) == 0
        out, err = capsys.readouterr()
        assert "debug" in err and "idle" in err and out.startswith("export SLURM_CONF=")
        # from another folder, without --work-dir: the cluster this shell's SLURM_CONF names (issue 37)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", str(folder / "slurm.conf"))
            patch.chdir(tmp_path.parent)
            assert main(["slurm", "status"]) == 0
        assert "debug" in capsys.readouterr().err
    finally:
        assert main(["slurm", "down", "--work-dir", str(tmp_path)]) == 0
    assert "stopped the local Slurm cluster" in capsys.readouterr().err
    assert not LocalSlurmCluster.in_folder(folder).running()
    assert main(["slurm", "status", "--work-dir", str(tmp_path)]) == 1
    assert "no local Slurm cluster runs" in capsys.readouterr().err
    assert main(["slurm", "sideways", "--work-dir", str(tmp_path)]) == 2
