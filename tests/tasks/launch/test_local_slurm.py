"""The local Slurm cluster the Slurm tests run on: it starts, runs an sbatch job with srun, and stops."""

import subprocess
import time


def test_an_sbatch_job_runs_srun_to_completion(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output={tmp_path}/out-%j.txt\nsrun hostname\n")
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    job_id = job.stdout.strip()
    state = ""
    for _ in range(200):
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        state = next(w for w in shown.split() if w.startswith("JobState=")).split("=")[1]
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            break
        time.sleep(0.2)
    assert state == "COMPLETED", f"job {job_id} on the Slurm cluster {slurm_cluster.conf} ended {state} or was still {state} after 40 s"
    lines = (tmp_path / f"out-{job_id}.txt").read_text().split()
    assert lines == [slurm_cluster.node] * 2
