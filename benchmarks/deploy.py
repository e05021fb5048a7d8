"""How long `kiln deploy` takes on a warm server, against `prefect deploy --all` of the same deployments.

Starts real servers (`kiln up` in a temporary work dir, free ports, SQLite), deploys once to warm them
(the work pool and the flows exist), then, `--repeats` times each, alternating, in fresh processes as
an operator runs them, from the same project folder:

- prefect: `prefect --no-prompt deploy --prefect-file <Kiln's prefect.yaml for the process pool> --all`
  (how `kiln deploy` registered them before: every entrypoint loaded again per deployment, every
  deployment written, one by one);
- kiln:    `kiln deploy` (the deployments registered from its own process, only those that changed,
  all at once; then the crashed-run detector), its whole command as timed by the operator's clock.

The very first `kiln deploy` on the fresh server (every deployment created) is timed too. After each
deploy every deployment's registered fields (entrypoint, pull steps, parameter schema, job variables,
work pool and queue, parameters, description, tags) are read back: they must stay those of the first
`kiln deploy`, through each `prefect deploy` (which rewrites them all), or the benchmark stops. Prints the medians, the load average, and last
`RESULT kiln_deploy_s <median seconds>` (goal: at most 10 s on a warm server; issue 35.11).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from kiln.flows.deploy import prefect_file_for

REPO = Path(__file__).resolve().parent.parent
KILN = [sys.executable, "-m", "kiln.flows.cli"]
FIELDS = ("entrypoint", "pull_steps", "parameter_openapi_schema", "job_variables", "work_pool_name",
          "work_queue_name", "parameters", "description", "tags", "enforce_parameter_schema")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def registered(api_url: str) -> dict[str, dict]:
    """Every deployment as the server holds it: name -> the fields both ways must agree on."""
    request = urllib.request.Request(f"{api_url}/deployments/filter", method="POST", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        deployments = json.loads(response.read())
    return {d["name"]: {f: d[f] for f in FIELDS} for d in deployments}


def timed(command: list[str], env: dict, cwd: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: about a minute for the servers and the first deploy, then "
                                            "5-45 s per deploy (2 x --repeats of them): 3-8 minutes with the defaults on 2 busy cores.")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed deploys of each kind, alternating (default: 3; each 5-40 s)")
    parser.add_argument("--tmp", default=None, help="where the servers' work dir goes (default: the system's temp "
                        "folder; removed at the end)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kiln-deploy-bench-", dir=args.tmp) as tmp:
        root = Path(tmp)
        ops, project = root / "ops", root / "project"
        project.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        env["XDG_STATE_HOME"] = str(root / "state")
        subprocess.run([*KILN, "up", "--work-dir", str(ops), "--prefect-port", str(free_port()),
                        "--mlflow-port", str(free_port())], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        try:
            for line in (ops / "servers" / "env").read_text().splitlines():
                name, value = line.removeprefix("export ").split("=", 1)
                env[name] = value
            prefect_file = root / "prefect.yaml"
            prefect_file.write_text(yaml.safe_dump(prefect_file_for("process"), sort_keys=False))
            prefect = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(prefect_file),
                       "--all"]
            kiln = [*KILN, "deploy"]
            deploy_env = {**env, "KILN_PROJECT_DIR": str(project)}
            first = timed(kiln, deploy_env, project)  # the server's first: every deployment created
            by_kiln = registered(env["PREFECT_API_URL"])
            seconds: dict[str, list[tuple[float, float]]] = {"prefect": [], "kiln": []}
            for _ in range(args.repeats):
                for name, command in (("prefect", prefect), ("kiln", kiln)):
                    seconds[name].append(timed(command, deploy_env, project))
                    fields = registered(env["PREFECT_API_URL"])
                    if fields != by_kiln:  # prefect deploy rewrote each one: it must have found kiln's the same
                        differ = sorted(n for n in fields.keys() | by_kiln.keys() if fields.get(n) != by_kiln.get(n))
                        sys.exit(f"after {name} deploy, {', '.join(differ)} differ from kiln deploy's registration")
            count = len(registered(env["PREFECT_API_URL"]))
        finally:
            subprocess.run([*KILN, "down", "--work-dir", str(ops)], cwd=REPO, env=env, stdout=subprocess.DEVNULL)

    load = os.getloadavg()
    print(f"{count} deployments, warm server (SQLite), {args.repeats} deploys of each kind, load average "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)")
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in seconds.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in seconds.items()}
    print(f"  kiln deploy, the server's first (all {count} created): {first[0]:.1f} s wall, {first[1]:.1f} s CPU")
    for name in ("prefect", "kiln"):
        print(f"  {name + ' deploy':<15} median {wall[name]:6.1f} s wall, {cpu[name]:5.1f} s CPU   all (wall/CPU): "
              f"{', '.join(f'{w:.1f}/{c:.1f}' for w, c in seconds[name])}")
    print("(a redeploy, nothing changed: prefect deploy writes every deployment again, kiln deploy reads them and "
          "writes none; kiln deploy's time includes its CLI's start, the work pool check and the crashed-run detector)")
    print(f"RESULT kiln_deploy_cpu_vs_prefect_deploy {cpu['kiln'] / cpu['prefect']:.2f}")
    print(f"RESULT kiln_deploy_s {wall['kiln']:.1f}")


if __name__ == "__main__":
    main()
