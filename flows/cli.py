"""The `kiln` command line: run the pipeline or one stage, inspect config, keys and the store.

Config and environment are resolved before Prefect is imported, because Prefect reads
`PREFECT_HOME` at import time and Kiln keeps it inside the run's working directory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import shlex
import shutil
import sys
import time
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# before torch loads libgomp (see flows/environment.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import yaml  # noqa: E402

import kiln  # noqa: E402
from kiln import __version__  # noqa: E402
from kiln.flows import embedded_api
from kiln.flows.database import SECRETS_FILE as DATABASE_SECRETS
from kiln.flows.deploy import continuous_eval_schedule, deploy, run_worker, serve, work_pool
from kiln.flows.environment import prepare_environment
from kiln.flows.image import check_image, find_runtime, installation_problems
from kiln.flows.project import init_project
from kiln.flows.servers import (
    ENV_FILE,
    REAP_EVERY_S,
    read_servers,
    running_work_dirs,
    servers_dir,
    start_reaper,
    start_servers,
    stop_reaper,
    stop_servers,
    stop_workers,
)
from kiln.tasks.config import (  # noqa: E402
    PACKAGED_DEFAULT,
    PROJECT_CONFIGS,
    config_chain,
    default_config_path,
    load_config,
)
from kiln.tasks.constants import METRICS_LOG
from kiln.tasks.continuous_state import status_lines
from kiln.tasks.crashes import reap_tracked, stale_tracked
from kiln.tasks.data.inspection import REPORT_JSON, render_sample, samples
from kiln.tasks.errors import KilnError  # noqa: E402
from kiln.tasks.evals.continuous import seconds
from kiln.tasks.graph import stage_keys
from kiln.tasks.launch.cluster import ClusterSpec, where_it_ran
from kiln.tasks.launch.local_slurm import LocalSlurmCluster
from kiln.tasks.launch.slurm_jobs import JobJournal, job_alive, live_jobs, lock_holder
from kiln.tasks.lineage import as_json, lineage, locate, render_table
from kiln.tasks.runner import StageOutcome
from kiln.tasks.scaling.plan import budget_from_accelerators, budget_report
from kiln.tasks.scaling.research import DECISION_FILE as RESEARCH_DECISION
from kiln.tasks.scaling.research import REPORT_FILE as RESEARCH_REPORT
from kiln.tasks.scaling.research import decision_table, promoted_config
from kiln.tasks.settings import KilnConfig, open_tracker
from kiln.tasks.stages import REGISTRY
from kiln.tasks.stages._common import SLURM_LOGS
from kiln.tasks.stages.train import with_longest_phase
from kiln.tasks.store import Store
from kiln.tasks.tracking import MlflowTracker
from kiln.tasks.train.config import ModelConfig

if TYPE_CHECKING:
    from kiln.tasks.stage import Stage

_EPILOG = """\
examples:
  kiln init my-project                       a project folder: kiln.yaml (extends Kiln's default), data/, README
  kiln run                                   the default pipeline (this folder's kiln.yaml, else Kiln's default:
                                             the bundled sample corpus, ~5 min on 2 CPU cores)
  kiln run kiln:configs/tiny.yaml            Kiln's one-minute slice of it (kiln:... names Kiln's own files)
  kiln run kiln.yaml train.run.steps=500 sweep.batch_sizes=[8,16]
  kiln run --until tokenize                  only the data stages
  kiln stage train                           one stage (its inputs must be complete)
  kiln status                                which stages are complete for this config
  kiln export anneal --out hf-model          the annealed model as a Hugging Face folder
  kiln eval --model hf --model_args pretrained=hf-model --tasks ...   lm-eval's own CLI, plus --model kiln
  kiln prune --dry-run                       partial folders that failed attempts left behind
  kiln lineage store/anneal/<key>/model      which data, settings and runs produced this model
  kiln config --keys                         the resolved config and every stage key
  kiln ui                                    how to open the MLflow and Prefect UIs
  kiln up --work-dir ops / kiln down         start / stop local Prefect and MLflow servers (source ops/servers/env)
  kiln slurm up / status / down              a local Slurm cluster in work_dir/slurm; run the export line it prints
  kiln deploy, then kiln worker              deployments on that server, run from this folder, and a worker

Without a CONFIG.yaml, this folder's kiln.yaml (or configs/default.yaml) is used, else Kiln's own
default (kiln:configs/default.yaml). Paths in a config (sources, work_dir) are relative to the folder
kiln runs in; a relative path this folder lacks that Kiln ships (data/sample/...) is Kiln's file.
Overrides are dotted keys (section.key=value, YAML values). Every output lands in the
working directory (work_dir, default ./kiln-work): the store, MLflow's database and
artifacts, and PREFECT_HOME (with `kiln up`'s servers, MLflow and Prefect keep their
records under that command's work_dir/servers).
"""


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for arg in args:
        if "=" not in arg and config is None and arg.endswith((".yaml", ".yml")):
            config = arg
        elif "=" in arg:
            overrides.append(arg)
        else:
            raise KilnError(f"argument {arg!r} is neither a config file (*.yaml) nor an override (key=value)")
    return config or default_config_path(), overrides


def _load(ns: argparse.Namespace) -> tuple[KilnConfig, str | None, list[str]]:
    config_path, overrides = _split_args(ns.args)
    if getattr(ns, "work_dir", None):
        overrides.append(f"work_dir={ns.work_dir}")
    return load_config(config_path, overrides), config_path, overrides


class _KilnErrorEcho(logging.Filter):
    """Drops the console echo of a run that failed on a KilnError (Prefect's traceback and failed-state
    line): `main` prints the error once, as `kiln: error: ...`. Any other exception's traceback is
    echoed once, with the task run that raised it: the flow run's echo of the same error (and a retried
    attempt's) keeps its line without the traceback, and `main` then says only that it failed.
    The Prefect API still gets the records whole: they reach this console handler, on the root
    logger, after the run loggers' API handlers have sent them."""

    _FAILED_STATE = re.compile(r"encountered an exception:? (\w+):")

    def __init__(self) -> None:
        super().__init__()
        self.echoed: set[tuple[str, str]] = set()  # errors whose traceback the console has shown

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            if isinstance(error, KilnError):
                return False
            if _error_id(error) in self.echoed:
                record.exc_info = record.exc_text = None
            self.echoed.add(_error_id(error))
            return True
        failed = self._FAILED_STATE.search(record.getMessage())
        return failed is None or failed.group(1) not in _subclass_names(KilnError)


def _error_id(error: BaseException) -> tuple[str, str]:
    """An error as the console shows it; Prefect may hand the flow a copy of the task's (a persisted result)."""
    return type(error).__name__, str(error)


def _subclass_names(cls: type) -> set[str]:
    return {cls.__name__}.union(*(_subclass_names(sub) for sub in cls.__subclasses__()))


_ECHO = _KilnErrorEcho()  # one per process: `main` asks it whether a traceback was shown


@contextlib.contextmanager
def _prefect_quiet() -> Iterator[None]:
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings


    embedded_api.wait_until_ready()  # started by prepare_environment, while the CLI imported the rest
    echo = _ECHO
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(echo)
    try:
        # Heartbeats detect crashed runs under a worker; local runs would spend ~1 s per subflow joining them.
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(echo)


def _ui_hint(cfg: KilnConfig) -> str:

    work = Path(cfg.work_dir).resolve()
    servers = {s.name: s.ui for s in read_servers(work)}
    mlflow_ui = servers.get("mlflow") or f"mlflow ui --backend-store-uri {cfg.tracking_uri} --port 5000   → http://127.0.0.1:5000"
    prefect_ui = servers.get("prefect") or (f"PREFECT_HOME={work / 'prefect'} prefect server start --host 127.0.0.1"
                                            "   → http://127.0.0.1:4200")
    return (
        "where to look next:\n"
        f"  outputs    {cfg.store_root.resolve()}/<stage>/<key>/  (kiln status lists them)\n"
        f"  MLflow UI  {mlflow_ui}\n"
        f"  Prefect UI {prefect_ui}\n"
        f"  plots      {cfg.store_root.resolve()}/fit/*/{{isoflop,law,hyperparameters,mixture}}.png, validate/*/{{law,capabilities}}.png\n"
        f"  servers    kiln up starts both UIs for this working directory; kiln down stops them"
    )


def cmd_run(ns: argparse.Namespace) -> int:
    cfg, config_path, overrides = _load(ns)

    prepare_environment(cfg)
    from kiln.flows.pipeline import pipeline, summary_table  # defers prefect

    started = time.perf_counter()
    print(f"kiln: running {config_path} in {Path(cfg.work_dir).resolve()}", file=sys.stderr)
    open_tracker(cfg)  # opened (the flow reuses it) while the Prefect API may still be starting
    with _prefect_quiet():
        outcomes = [StageOutcome(**o) for o in pipeline(config_path, overrides, ns.until)]
    print(summary_table(outcomes))
    cached = sum(o.status == "cached" for o in outcomes)
    print(f"\n{len(outcomes)} stages ({cached} cached) in {time.perf_counter() - started:.1f}s\n")
    print(_ui_hint(cfg))
    return 0


def _run_one_stage(name: str, ns: argparse.Namespace, extra_overrides: tuple[str, ...] = ()):
    cfg, config_path, overrides = _load(ns)
    overrides += extra_overrides

    prepare_environment(cfg)
    from kiln.flows.pipeline import summary_table  # defers prefect
    from kiln.flows.stages import flow_for  # defers prefect

    if name not in REGISTRY:
        raise KilnError(f"unknown stage {name!r}; stages are: {', '.join(REGISTRY.names())}")
    with _prefect_quiet():
        outcome = StageOutcome(**flow_for(name)(config_path, overrides))
    print(summary_table([outcome]))
    return outcome


def adjustment(config_path: str | None, changes: list[str], from_step: int, work_dir: str | None = None
               ) -> tuple[str, list[str]]:
    """The train key of the run `config_path` trains (the prefix) and the overrides of its adjustment:
    `changes`, then `train.branch` naming that key and `from_step`."""
    if not changes:
        raise KilnError("kiln adjust needs at least one change (key=value), e.g. train.phases=[...] or "
                        "train.run.steps=2000: without one the adjusted run would be the run itself")
    base = [f"work_dir={work_dir}"] if work_dir else []
    prefix = stage_keys(load_config(config_path or default_config_path(), base))["train"]
    return prefix, [*changes, f"train.branch={{prefix: '{prefix}', from_step: {from_step}}}"]


def cmd_adjust(ns: argparse.Namespace) -> int:
    config_path, changes = _split_args(ns.args)
    prefix, overrides = adjustment(config_path, changes, ns.from_step, ns.work_dir)
    ns.args = [config_path, *overrides]
    outcome = _run_one_stage("train", ns)
    print(f"\ntrain {outcome.key}: train {prefix} up to step {ns.from_step}, then {' '.join(changes)}")
    return 0


def cmd_stage(ns: argparse.Namespace) -> int:
    _run_one_stage(ns.name, ns)
    return 0


def cmd_init(ns: argparse.Namespace) -> int:
    """Write a project folder whose config extends Kiln's (`flows/project.py`)."""

    root = Path(ns.dir)
    done = init_project(root, ns.extends)
    print(f"kiln: a Kiln project in {root.resolve()}")
    for name in done.written:
        print(f"  wrote {name}")
    for name in done.kept:
        print(f"  kept  {name} (the folder had it)")
    print(f"\nnext: cd {shlex.quote(str(root))} && kiln run   (Kiln's sample corpus, as {ns.extends} runs it; "
          "kiln.yaml says how to name your own data)")
    return 0


def cmd_image(ns: argparse.Namespace) -> int:
    """`kiln image check [IMAGE]`: this installation's files, or those of the Kiln inside IMAGE (`flows/image.py`)."""

    if ns.image is None:
        report = installation_problems()
        for problem in report.problems:
            print(f"kiln: problem: {problem}", file=sys.stderr)
        print(report.summary() if not report.problems else f"kiln: {len(report.problems)} problem(s) in this installation")
        return 1 if report.problems else 0
    runtime = find_runtime(ns.runtime)
    failed = 0
    for command, done in check_image(ns.image, runtime):
        print(f"$ {command}\n{done.stdout.rstrip()}")
        if done.returncode != 0:
            failed += 1
            print(f"{done.stderr.rstrip()}\nkiln: exit {done.returncode}", file=sys.stderr)
    print(f"kiln: {ns.image} {'fails' if failed else 'passes'} the check ({runtime.name})")
    return 1 if failed else 0


def cmd_config(ns: argparse.Namespace) -> int:
    cfg, config_path, _ = _load(ns)
    # the files it was resolved from: Kiln's own by their kiln: name, with where this installation has them
    for i, (name, file) in enumerate(config_chain(config_path)):
        where = f"  ({file.resolve()})" if name.startswith("kiln:") else ""
        print(f"# {'resolved from' if i == 0 else '         over'}: {name}{where}")
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True), end="")
    if ns.keys:

        print("\n# stage keys")
        print(yaml.safe_dump(stage_keys(cfg), sort_keys=False), end="")
    return 0


def _fit(parts: list[str], room: int) -> str:
    """`parts` joined by ", " within `room` characters; what does not fit is counted, not printed."""
    shown: list[str] = []
    for part in parts:
        rest = len(parts) - len(shown) - 1
        tail = f", ... {rest} more" if rest else ""
        if len(", ".join([*shown, part]) + tail) > room:
            return ", ".join(shown) + f"{', ' if shown else ''}... {len(parts) - len(shown)} more"
        shown.append(part)
    return ", ".join(shown)


def _stage_state(store: Store, stage: Stage, key: str, room: int) -> tuple[str, dict]:
    """A stage's state in the store as one line of at most `room` characters, and its cost (complete only)."""
    problems = store.problems(stage.name, key)
    if not problems:
        manifest = store.manifest(stage.name, key)
        numbers = [f"{k}={v}" for k, v in manifest["stats"].get("headline", {}).items()]
        return f"complete  {manifest['wall_s']:6.1f}s  {_fit(numbers, room - 19)}", manifest.get("cost", {})
    if store.path(stage.name, key).exists():
        return _cut(f"damaged ({'; '.join(problems)}): the next run redoes it", room), {}
    if not store.partial_path(stage.name, key).exists():
        return "missing", {}
    lock = store.lock(stage.name, key, job_alive=job_alive)
    if lock.held():
        partial = store.partial_path(stage.name, key)
        return _cut(f"running{_live_step(partial)} (held by {lock_holder(lock.owner() or {})})", room), {}
    live = _live_jobs(store.partial_path(stage.name, key))
    failure = store.failure(stage.name, key)
    if failure is not None and not live:
        then = ("a rerun resumes it" if failure["retryable"] else
                "fix the config, then rerun" if failure.get("config") else "fix it, then rerun")
        return _cut(f"failed ({then}): {failure['error']}: {' '.join(failure['message'].split())}", room), {}
    if live:
        return _cut(f"partial, its driver gone but Slurm still runs {'; '.join(live)}: the next run waits for "
                    f"them (scancel to stop them)", room), {}
    return "partial (an attempt crashed or was stopped; the next run resumes or redoes it)", {}


def _live_step(partial: Path, tail_bytes: int = 8192) -> str:
    """Where a running training stage is, from the last whole line rank 0 appended to its metrics log
    (read from the file's end: a months-long run's log is long): ' at step N (loss L, T s ago)';
    '' for a stage that logs no steps (or none yet)."""
    log = partial / METRICS_LOG
    try:
        size, modified = log.stat().st_size, log.stat().st_mtime
        with log.open("rb") as handle:
            handle.seek(max(0, size - tail_bytes))
            lines = handle.read().split(b"\n")
    except OSError:
        return ""
    whole = lines[1 if size > tail_bytes else 0:-1]  # a cut first line and an unfinished last one are left out
    for line in reversed(whole):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "step" in record and "loss" in record:
            return f" at step {record['step']} (loss {record['loss']:.4f}, {time.time() - modified:.0f} s ago)"
    return ""


def _live_jobs(partial: Path) -> list[str]:
    """The Slurm jobs a data stage's attempt submitted (its journal, `logs/slurm_jobs.jsonl`) that still run."""
    journal = JobJournal(partial / SLURM_LOGS)
    jobs = journal.open_jobs()
    live = set(live_jobs([job["job_id"] for job in jobs])) if jobs else set()
    return [f"job {job['job_id']} ({job['job_name']} ranks {','.join(map(str, job['ranks']))}, submitted by pid "
            f"{job['pid']} on {job['host']})" for job in jobs if job["job_id"] in live]


def _cut(text: str, room: int) -> str:
    return text if len(text) <= room else text[:max(room - 3, 0)].rstrip() + "..."


def cmd_status(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)

    store = Store(cfg.store_root)
    keys = stage_keys(cfg)
    print(f"store: {store.root.resolve()}")
    width = max(len(name) for name in REGISTRY.names())
    # a row's numbers are cut to the terminal's width (160 when not a terminal); the manifest has them all
    columns = max(shutil.get_terminal_size((160, 24)).columns, 100)
    totals: dict[str, float] = {}
    for stage in REGISTRY:
        key = keys[stage.name]
        state, cost = _stage_state(store, stage, key, columns - width - len(key) - 5)
        if state == "missing" and not stage.in_pipeline:
            continue  # an on-demand stage (kiln dedup-batch) is not owed by the pipeline
        for name, value in cost.items():
            if name == "peak_rss_mb":
                totals[name] = max(totals.get(name, 0.0), value)
            elif name != "forecast_ratio":  # a ratio per stage; the totals give the pipeline's
                totals[name] = totals.get(name, 0.0) + value
        print(f"  {stage.name:<{width}} {key}  {state}")
        if state.startswith("complete"):
            for line in where_it_ran(store.manifest(stage.name, key).get("launch", {})):
                print(f"  {'':<{width}} {line}"[:columns])
    if totals:
        forecast = (f" (the planner forecast {totals['forecast_accelerator_s'] / 3600:.3g} for its training stages)"
                    if "forecast_accelerator_s" in totals else "")
        print(f"cost of this pipeline's complete stages: {totals.get('wall_s', 0):.0f} s wall, "
              f"{totals.get('cpu_s', 0):.0f} s CPU, {totals.get('accelerator_s', 0) / 3600:.2f} accelerator-hours"
              f"{forecast}, peak memory {totals.get('peak_rss_mb', 0):.0f} MiB")

    print("\n".join(status_lines(cfg, keys)))
    schedule = continuous_eval_schedule()  # with a Prefect server (kiln up's env) that has the deployment
    if schedule is not None:
        print(schedule)
    stale = _stale(cfg)
    if stale[:1] and stale[0].startswith("not checked:"):
        print(f"records a crash left running: {stale.pop(0)}")
    if stale:
        print(f"{len(stale)} record(s) a crash left running (kiln reap marks them; kiln up's reaper does every "
              f"{REAP_EVERY_S} s):")
        for line in stale:
            print(f"  stale: {line}")  # whole: the reason is the point
    abandoned = store.abandoned_partials(keys)
    if abandoned:
        print(f"{len(abandoned)} abandoned partial folder(s) of keys this config no longer uses "
              f"(`kiln prune` removes them): {', '.join(str(p.relative_to(store.root)) for p in abandoned)}")
    if ns.json:
        print(json.dumps(keys, indent=2))
    return 0


def _tracker_if_any(cfg: KilnConfig) -> MlflowTracker | None:
    """The config's MLflow experiment where there is one to read: a server, a configured store, or the
    work dir's SQLite file once a run created it (reading must not create one)."""
    uri = cfg.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        return None
    return open_tracker(cfg)


def _stale(cfg: KilnConfig) -> list[str]:
    """What a crash left running, as `kiln status` lists it: Prefect's records too with a Prefect server.
    A tracking server that does not answer is said, not waited for (its client retries for minutes)."""
    uri = cfg.tracking_uri
    if uri.startswith(("http://", "https://")) and not _answers(uri.rstrip("/") + "/health"):
        return [f"not checked: the MLflow server at {uri} does not answer (kiln up restarts it)"]
    tracker = _tracker_if_any(cfg)
    if os.environ.get("PREFECT_API_URL"):
        from kiln.flows.crashes import stale  # defers prefect

        return stale(tracker)
    if tracker is None:
        return []
    return [f"MLflow run {name} ({run_id}) still RUNNING: {why}" for run_id, (name, why) in stale_tracked(tracker).items()]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def cmd_reap(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)
    tracker = _tracker_if_any(cfg)
    if os.environ.get("PREFECT_API_URL"):
        from kiln.flows.crashes import reap_crashed, reap_every  # defers prefect

        if ns.every is not None:
            reap_every(tracker, seconds(ns.every))
        tasks, runs = reap_crashed(tracker, say=True)
    elif ns.every is not None:
        raise KilnError("--every keeps reaping a Prefect server's records: give it one (kiln up, then "
                        "source <work_dir>/servers/env), or run kiln reap once without --every")
    else:
        reaped = reap_tracked(tracker) if tracker is not None else {}
        for run_id, why in reaped.items():
            print(f"marked FAILED: MLflow run {run_id}: {why}")
        tasks, runs = 0, len(reaped)
    print(f"marked {tasks} Prefect task run(s) and {runs} MLflow run(s) that a crash left running"
          + ("" if os.environ.get("PREFECT_API_URL") else " (no Prefect server: MLflow's runs only)"))
    return 0


def cmd_lineage(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)

    store = Store(cfg.store_root)
    links = lineage(store, *locate(store, ns.ref))
    print(as_json(links) if ns.json else render_table(links))
    return 0


def cmd_inspect(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)

    keys = stage_keys(cfg)
    if ns.name not in keys:
        raise KilnError(f"unknown stage {ns.name!r}; data stages write removed shards: collect, clean, dedup, decontaminate")
    store = Store(cfg.store_root)
    if not store.is_complete(ns.name, keys[ns.name]):
        raise KilnError(f"stage {ns.name} ({keys[ns.name]}) is not complete in {store.root}: run `kiln run --until {ns.name}`")
    folder = store.path(ns.name, keys[ns.name])
    outcome = "kept" if ns.kept else "quarantined" if ns.quarantined else "removed"
    shown = [render_sample(sample) for sample in samples(folder, outcome=outcome, reason=ns.reason, domain=ns.domain, n=ns.n)]
    print("\n".join(shown) if shown else f"no {outcome} documents match in {folder}")
    report = folder / REPORT_JSON
    if not shown and report.is_file() and outcome != "kept":  # say what there is to look at
        table = json.loads(report.read_text())
        reasons = sorted({name for row in table.values() for name in row[outcome]})
        print(f"{outcome} by filter: {', '.join(reasons) or 'none'}; domains: {', '.join(table)}")
    return 0


def cmd_prune(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)

    store = Store(cfg.store_root)
    folders = store.abandoned_partials(None if ns.all else stage_keys(cfg))
    for folder in folders:
        print(f"{'would remove' if ns.dry_run else 'removing'} {folder}")
    freed = 0 if ns.dry_run else store.prune(folders)
    print(f"{len(folders)} partial folder(s), {freed / 1e6:.1f} MB freed")
    return 0


def cmd_dedup_batch(ns: argparse.Namespace) -> int:
    """Deduplicate a newly delivered batch against everything the dedup stage already kept."""
    batch = Path(ns.batch).resolve()
    outcome = _run_one_stage("dedup-batch", ns, (f"dedup_batch.batch={batch}",))
    print(f"\nkept documents, removed shards and the extended LSH index: {outcome.path}")
    return 0


def cmd_batch(ns: argparse.Namespace) -> int:
    """Bring a newly delivered batch through collect, clean, dedup, decontaminate and tokenize (the batch stage),
    and say how a production run takes it in."""
    source = {"name": ns.name, "path": str(Path(ns.path).resolve()), "format": ns.format, "domain": ns.domain}
    if ns.licence:
        source["licence"] = ns.licence
    sources = "batch.sources=[{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in source.items()) + "}]"
    outcome = _run_one_stage("batch", ns, (f"batch.name={ns.name}", sources))
    config_path, _ = _split_args(ns.args)
    print(f"\nbatch {outcome.key}: {outcome.path}\neligible at the next adjustment point: kiln adjust "
          f"{shlex.quote(config_path)} --from-step N train.batches=[{outcome.key}]")
    return 0


def cmd_research(ns: argparse.Namespace) -> int:
    """Run (or reuse) the research stage, print its decision table, and with --promote write the production
    config with that variant applied."""
    cfg, config_path, overrides = _load(ns)
    keys, store = stage_keys(cfg), Store(cfg.store_root)
    missing = [name for name in REGISTRY["research"].inputs if not store.is_complete(name, keys[name])]
    if missing:  # a fresh clone: the study trains on the config's own data, made first as `kiln run` makes it
        command = " ".join(["kiln run", *([config_path] if config_path else []), "--until", missing[-1]])
        print(f"kiln research: {', '.join(missing)} is not in {store.root} yet: running the data stages it needs "
              f"first (`{command}`)", file=sys.stderr)
        prepare_environment(cfg)
        from kiln.flows.pipeline import pipeline, summary_table  # defers prefect

        with _prefect_quiet():
            print(summary_table([StageOutcome(**o) for o in pipeline(config_path, overrides, missing[-1])]))
    outcome = _run_one_stage("research", ns)
    folder = Path(outcome.path)
    decision = json.loads((folder / RESEARCH_DECISION).read_text())
    print(f"\n{decision_table(decision)}\n\nnoise floor {decision['noise_floor']:.4f}; decision {folder / RESEARCH_DECISION}; "
          f"report {folder / RESEARCH_REPORT}")
    if not decision["lr_sweep"]:
        print("warning: research.lr_sweep is empty: every variant trained at the baseline's learning rate")
    if ns.promote:
        written = promoted_config(Path(config_path), folder / RESEARCH_DECISION, ns.promote, outcome.key,
                                  isinstance(cfg.train.model, ModelConfig))
        print(f"production config with {ns.promote} applied: {written}")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    """Write a Kiln model as a Hugging Face folder (transformers, lm-eval's `hf` model) with its model card."""
    cfg, _, _ = _load(ns)
    from kiln.tasks.evals.export_hf import export_source  # defers torch

    written = export_source(Store(cfg.store_root), ns.source, Path(ns.out), keys=stage_keys(cfg),
                            tokenizer=Path(ns.tokenizer) if ns.tokenizer else None, dtype=ns.dtype)
    print(f"{written['architecture']}, {written['num_params']:,} parameters ({written['dtype']}), from "
          f"{written['exported_from']}, tokenizer {written['tokenizer']}\n→ {Path(ns.out).resolve()}\n"
          f"try: lm_eval --model hf --model_args pretrained={Path(ns.out).resolve()} --tasks ...")
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    """lm-eval's own command line (every flag of `lm_eval run`), with Kiln's adapter registered as `--model kiln`."""
    from lm_eval.__main__ import cli_evaluate

    import kiln.tasks.evals.adapter  # noqa: F401  (registering the model is the import's effect); defers torch

    argv = sys.argv
    sys.argv = ["lm_eval", *ns.lm_eval_args]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = argv
    return 0


def cmd_continuous_eval(ns: argparse.Namespace) -> int:
    """Evaluate the train and anneal checkpoints that are due and not yet evaluated, once (the deployment repeats it)."""
    cfg, config_path, overrides = _load(ns)

    prepare_environment(cfg)
    from kiln.flows.continuous_eval import continuous_eval  # defers prefect

    with _prefect_quiet():
        summaries = continuous_eval(config_path, overrides)
    for stage, summary in summaries.items():
        skipped = "".join(f"\n  step {step} skipped: {reason}" for step, reason in summary["skipped"].items())
        elsewhere = (f"\n  steps {summary['scored_elsewhere']} were scored meanwhile by another run"
                     if summary["scored_elsewhere"] else "")
        events = "".join(f"\n  regression {'started' if r['kind'] == 'started' else 'cleared'}: {r['task']} "
                         f"{r['metric']} at step {r['step']}: {r['current']:.4f}, best {r['best']:.4f} at step "
                         f"{r['best_step']} (noise {r['noise']:.4f})" for r in summary["regressions"])
        still = "".join(f"\n  open regression: {r['task']} {r['metric']} since step {r['since']}"
                        for r in summary["open_regressions"] if r not in summary["regressions"])
        left_out = (f"\n  regressions of tasks the evaluate stage judged not trusted, left out of the alerts: "
                    f"{', '.join(summary['not_trusted'])}" if summary.get("not_trusted") else "")
        print(f"{stage} {summary['key']}: evaluated steps {summary['evaluated'] or 'none new'}; "
              f"{len(summary['recorded'])} steps recorded in {summary['state_file']}{skipped}{elsewhere}{events}{still}"
              f"{left_out}")
    ecg = next((s["ecg"] for s in summaries.values() if s["ecg"]), None)
    if ecg:
        print(f"ECG (each task's score against the step): {ecg}")
    return 0


def cmd_ui(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)
    print(_ui_hint(cfg))
    return 0


def cmd_up(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)

    restarted: list[str] = []
    servers = start_servers(cfg.work_dir, prefect_port=ns.prefect_port, mlflow_port=ns.mlflow_port,
                            prefect_database=ns.prefect_database, mlflow_database=ns.mlflow_database,
                            database_kind=ns.database, restarted=restarted)
    if restarted:
        they = "it" if len(restarted) == 1 else "they"
        print(f"restarted {', '.join(restarted)} ({they} had stopped or died) on the port and database {they} had")
    for server in servers:
        print(f"{server.name:<8} {server.ui:<24} pid {server.pid}  log {server.log}")
    pid, restarted_reaper = start_reaper(cfg.work_dir, list(ns.args))
    if restarted_reaper:
        print("restarted the reaper (it had died)")
    print(f"{'reaper':<8} {'every ' + str(REAP_EVERY_S) + ' s':<24} pid {pid}  log "
          f"{servers_dir(cfg.work_dir) / 'reaper.log'}  (marks what a crash left running)")
    if any(server.name == "postgres" for server in servers):
        print(f"its role and password (owner-only; keep it): {servers_dir(cfg.work_dir) / DATABASE_SECRETS}")
    print(f"\npoint kiln, workers and deployments at them:  source {servers_dir(cfg.work_dir) / ENV_FILE}")
    return 0


def cmd_down(ns: argparse.Namespace) -> int:
    cfg, _, _ = _load(ns)

    work = Path(cfg.work_dir).resolve()
    named = bool(ns.work_dir) or any(a.startswith("work_dir=") or a.endswith((".yaml", ".yml")) for a in ns.args)
    running = running_work_dirs()
    if not named and work not in running and running:  # nothing here: the last `kiln up`, wherever it was
        work = running[0]
        print(f"no kiln servers for {Path(cfg.work_dir).resolve()}; stopping those of the last `kiln up`, for {work}")
    workers, still = stop_workers(work)  # first: a worker left without its server only waits on it
    if workers:
        print(f"stopped kiln worker(s): pid {', '.join(map(str, workers))} (the flow runs they started go on)")
    if still:
        print(f"kiln worker(s) still running after SIGTERM: pid {', '.join(map(str, still))} (kill them with kill -9)")
    reaper = stop_reaper(work)
    if reaper is not None:
        print(f"stopped the reaper: pid {reaper}")
    stopped = stop_servers(work)
    print(f"stopped: {', '.join(stopped)}" if stopped else f"no kiln servers were running for {work}")
    others = [w for w in running if w != work]
    if others:
        print("kiln servers still run for: " + ", ".join(f"{w} (kiln down --work-dir {w})" for w in others))
    return 0


def cmd_slurm(ns: argparse.Namespace) -> int:
    """`kiln slurm up | down | status`: a local Slurm cluster in work_dir/slurm, for trying the Slurm paths.
    stdout gets only the `export SLURM_CONF=...` line (`eval "$(kiln slurm up)"`); the rest goes to stderr."""
    if ns.action not in ("up", "down", "status"):
        raise KilnError(f"kiln slurm {ns.action}: the actions are up, down and status")
    cfg, _, _ = _load(ns)

    folder = Path(cfg.work_dir).resolve() / "slurm"
    exported = os.environ.get("SLURM_CONF")
    if ns.action != "up" and LocalSlurmCluster.in_folder(folder) is None and exported and \
            LocalSlurmCluster.in_folder(Path(exported).parent) is not None:
        folder = Path(exported).parent  # not in this work dir: the local cluster this shell's SLURM_CONF names
    existing = LocalSlurmCluster.in_folder(folder)
    up = existing is not None and existing.running()
    if ns.action == "up":
        if up:
            print(f"kiln: a local Slurm cluster already runs in {folder} ({', '.join(existing.node_names)})",
                  file=sys.stderr)
        else:
            existing = LocalSlurmCluster(folder, cpus=ns.cpus, nodes=ns.nodes).start()
            print(f"kiln: started a local Slurm cluster in {folder}: {len(existing.node_names)} node(s) "
                  f"({', '.join(existing.node_names)}), {existing.cpus} CPUs each, partition "
                  f"{existing.partition}; `kiln slurm down` stops it", file=sys.stderr)
        print(f"export SLURM_CONF={existing.conf}")
        return 0
    if ns.action == "down":
        if existing is None or not up:
            print(f"kiln: no local Slurm cluster runs in {folder}", file=sys.stderr)
            return 0
        existing.stop()
        print(f"kiln: stopped the local Slurm cluster in {folder} (its jobs cancelled); unset SLURM_CONF",
              file=sys.stderr)
        return 0
    if not up:
        print(f"kiln: no local Slurm cluster runs in {folder} (kiln slurm up starts one)", file=sys.stderr)
        return 1
    import subprocess

    env = {**os.environ, **existing.env}
    for argv in (["sinfo", "--Node", "--format", "%N %P %T %c"], ["squeue", "--format", "%i %j %T %M %N"]):
        shown = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        print(shown.stdout.rstrip() or shown.stderr.strip(), file=sys.stderr)
    print(f"export SLURM_CONF={existing.conf}")
    return 0


def cmd_deploy(ns: argparse.Namespace) -> int:

    print(deploy(ns.continuous_eval, ns.overrides, ns.alert_webhook, ns.work_pool, ns.image, ns.every))
    pool = work_pool(ns.work_pool)["name"]
    worker = "kiln worker   (where PREFECT_API_URL and MLFLOW_TRACKING_URI are these)" if ns.work_pool == "process" else \
        f"in the cluster, prefect worker start --pool {pool} --type kubernetes (needs prefect-kubernetes)"
    ui = os.environ["PREFECT_API_URL"].removesuffix("/").removesuffix("/api")
    print(f"start a worker: {worker}\nrun the pipeline: prefect deployment run kiln-pipeline/pipeline "
          f"--param config_path=CONFIG.yaml   (or Run in the UI: {ui}/deployments)")
    return 0


def cmd_worker(ns: argparse.Namespace) -> int:

    run_worker()
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:

    serve(ns.continuous_eval, ns.overrides, ns.every)
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    from kiln.tasks.train.planner import (  # defers torch
        load_preset,
        plan_parallelism,
        plan_phases,
        plan_presets,
        render_phase_plans,
        render_plan_report,
        resolve_parallel,
    )

    if ns.budget is not None or ns.hours is not None:  # the compute-optimal run from the config's fit

        cfg = load_config(ns.config or default_config_path(), ns.overrides)
        cluster = load_preset(ns.cluster, ClusterSpec) if ns.cluster else cfg.cluster
        try:
            compute = ns.budget if ns.budget is not None else budget_from_accelerators(
                cluster.world_size, ns.hours, cluster.peak_tflops, cluster.mfu)
        except ValueError as error:
            raise KilnError(f"--hours: {error} (describe GPUs: cluster.gpus_per_node, or --cluster PRESET)") from None
        store, keys = Store(cfg.store_root), stage_keys(cfg)
        for stage in ("sweep", "fit"):
            if not store.is_complete(stage, keys[stage]):
                raise KilnError(f"no completed {stage} stage for this config in {cfg.store_root} (key {keys[stage]}): "
                                "run `kiln run CONFIG --until fit` first")
        text, planned = budget_report(cfg.sweep, compute, store.path("fit", keys["fit"]),
                                      store.path("sweep", keys["sweep"]))
        print(json.dumps(planned, indent=2) if ns.json else text, end="")
        return 0
    if ns.config is not None:  # what `train.parallel: auto` picks for this config's train stage
        cfg = load_config(ns.config, ns.overrides)
        cluster = load_preset(ns.cluster, ClusterSpec) if ns.cluster else cfg.cluster
        if cfg.train.model == "plan" and not ns.model:
            raise KilnError("train.model is `plan`: its shape comes from the fit; see it with --budget, or give --model")
        model = load_preset(ns.model, ModelConfig) if ns.model else cfg.train.model
        model = with_longest_phase(model, cfg.train.run, cfg.train.phases)  # a long-context phase raises it
        phases = [(p.name, p.seq_len or cfg.train.run.seq_len) for p in cfg.train.phases]
        run = cfg.train.run.model_copy(update={"device": "cuda"}) if cluster.gpus_per_node else cfg.train.run
        dims, run = resolve_parallel("auto", model, run, cfg.tokenize.vocab_size, cluster)
        if not cluster.gpus_per_node:
            print(f"train.parallel: auto on a CPU cluster is data parallel, one process per node: {dims.model_dump()} "
                  f"(grad_accum {run.grad_accum}); describe GPUs (cluster.gpus_per_node, or --cluster PRESET) to plan")
            return 0
        search = plan_parallelism(model, cfg.tokenize.vocab_size, run.seq_len, cluster, global_batch_seqs=run.batch_size,
                                  precision=ns.precision)
    else:
        phases = []
        missing = [flag for flag, value in (("--model", ns.model), ("--cluster", ns.cluster)) if not value]
        if missing:
            raise KilnError(f"kiln plan needs {', '.join(missing)} (or a CONFIG to plan its train stage)")
        search = plan_presets(ns.model, ns.cluster, ns.vocab_size, ns.seq_len, ns.global_batch_seqs,
                              ns.global_batch_tokens, ns.precision)
    phase_plans = plan_phases(search, phases) if search.best is not None else []
    verification = None
    if ns.verify and search.best is not None:
        from kiln.tasks.train.verify import render_verification, verify_plan  # defers torch

        verification = verify_plan(search)
    if ns.json:
        record = search.to_dict() | ({"verification": verification.to_dict()} if verification else {})
        record |= {"phases": [p.to_dict() for p in phase_plans]} if phase_plans else {}
        print(json.dumps(record, indent=2))
    else:
        print(render_plan_report(search) + render_phase_plans(search, phase_plans)
              + (render_verification(verification) if verification else ""), end="")
    return 0 if search.best and (verification is None or verification.agrees) else 1


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="kiln", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description=f"Kiln: an end-to-end LLM pretraining pipeline ({' → '.join(REGISTRY.pipeline())}) "
                    "on Prefect and MLflow.",
    )
    parser.add_argument("--version", action="version", help="print Kiln's version and where it is installed",
                        version=f"kiln {__version__} from {Path(kiln.__file__).resolve().parent} "
                                f"(python {sys.version.split()[0]})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, func, first: tuple[str, str] | None = None,
            args_help: str = f"a config file (default: this folder's {' or '.join(PROJECT_CONFIGS)}, else "
                             f"{PACKAGED_DEFAULT}) and dotted overrides, e.g. train.run.steps=100",
            ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG)
        if first:
            p.add_argument(first[0], help=first[1])
        p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]", help=args_help)
        _work_dir_option(p)
        p.set_defaults(func=func)
        return p

    init = sub.add_parser("init", help="Write a project folder: kiln.yaml (extends Kiln's default config; kiln run "
                          "there works at once, on Kiln's sample corpus), a README, a .gitignore and data/ for your own.",
                          description="Write a project folder: kiln.yaml, which extends Kiln's default config (so "
                          "`kiln run` there works at once, on Kiln's bundled sample corpus) and says in comments what "
                          "to set for your own data; README.md; .gitignore; data/raw, data/evals and data/lists. "
                          "Existing files are kept; a folder with a kiln.yaml is refused.")
    init.add_argument("dir", help="the project folder (created if missing)")
    init.add_argument("--extends", default=PACKAGED_DEFAULT, metavar="CONFIG",
                      help=f"the config kiln.yaml extends (default {PACKAGED_DEFAULT}; kiln:configs/tiny.yaml runs in "
                           "about a minute; a path is written absolute)")
    init.set_defaults(func=cmd_init)
    image_help = ("Check a container image of Kiln (infra/container/Dockerfile): run `kiln --version` and the packaged-files "
                  "check inside IMAGE with docker, podman or apptainer; without IMAGE, check this installation (the entry "
                  "point, every installed file against the wheel's RECORD, Kiln's shipped files, the default config's data).")
    image = sub.add_parser("image", help=image_help, description=image_help)
    image.add_argument("action", choices=["check"], help="check")
    image.add_argument("image", nargs="?", help="an image reference (kiln:0.1.0-cpu, registry/kiln:0.1.0-cuda), an "
                       "apptainer .sif file or docker:// URL; none: this installation")
    image.add_argument("--runtime", choices=["docker", "podman", "apptainer"],
                       help="the container runtime (default: the first that answers)")
    image.set_defaults(func=cmd_image)
    run = add("run", "Run the pipeline; stages whose outputs are complete are reused (cached).", cmd_run)
    run.add_argument("--until", metavar="STAGE", help="stop after this stage (e.g. tokenize)")
    add("stage", "Run one stage as its own Prefect flow; its inputs must already be complete.", cmd_stage,
        first=("name", "the stage name (kiln status lists them)"))
    batch = add("batch", "Bring a new data batch through collect, clean, dedup (against the persisted index), decontaminate and "
                "tokenize (the corpus's tokenizer); the result is a store entry of stage batch, which "
                "`kiln adjust CONFIG --from-step N train.batches=[KEY]` makes eligible after step N.", cmd_batch,
                first=("path", "the new documents: a file or folder, read as a collect source of --format"))
    batch.add_argument("--name", required=True, help="the batch's name (its sources are batch/NAME/DOMAIN in the accounting)")
    batch.add_argument("--domain", required=True, help="the domain of its documents (one the mixture has)")
    batch.add_argument("--format", default="jsonl", help="the source format, as collect.sources take it (default jsonl)")
    batch.add_argument("--licence", help="an SPDX licence, where the documents carry none of their own")
    adjust = add("adjust", "Change a production run from a step on without retraining what came before: the train "
                           "run of CONFIG goes on from its kept checkpoint of --from-step under CONFIG plus the "
                           "changes (key=value: the data schedule train.phases, train.run.steps, ...), as a new "
                           "run whose key derives from the first run's key, the step and the changes.", cmd_adjust)
    adjust.add_argument("--from-step", type=int, required=True, help="the kept train checkpoint to go on from")
    config = add("config", "Print the resolved config (file + overrides + defaults).", cmd_config)
    config.add_argument("--keys", action="store_true", help="also print every stage's key")
    status = add("status", "Show each stage's key and its state in the store: complete (with its key numbers), running, "
                 "failed (with the error), partial (a crashed attempt) or missing; the pipeline's cost; and continuous eval "
                 "per series: checkpoints scored, pending and missed, open regressions, the ECG's path.", cmd_status)
    status.add_argument("--json", action="store_true", help="also print the keys as JSON")
    lineage = add("lineage", "Print the chain of store entries behind an output, from raw sources to the model: "
                  "keys, config, output digests, MLflow and Prefect runs, code version, licences.", cmd_lineage,
                  first=("ref", "a stage key, stage/key, an MLflow run id, or a path inside the store (a checkpoint)"))
    lineage.add_argument("--json", action="store_true", help="print the chain as JSON")
    inspect = add("inspect", "Print removed (or kept, or quarantined) documents of a data stage with their reasons, "
                  "so a person can judge a filter in a minute.", cmd_inspect,
                  first=("name", "a data stage: collect, clean, dedup, decontaminate"))
    inspect.add_argument("--reason", metavar="R", help="a filter (gopher_quality) or a full reason (gopher_quality:...)")
    inspect.add_argument("--domain", metavar="D", help="only documents of this domain")
    inspect.add_argument("-n", type=int, default=5, help="how many (default 5)")
    shown = inspect.add_mutually_exclusive_group()
    shown.add_argument("--kept", action="store_true", help="kept documents instead (with their quality_score)")
    shown.add_argument("--quarantined", action="store_true", help="quarantined inputs instead")
    prune = add("prune", "Remove partial folders that no running stage writes and that belong to keys this config "
                "no longer uses (left by failed attempts whose fix changed the key).", cmd_prune)
    prune.add_argument("--all", action="store_true", help="also remove crashed attempts of this config's keys "
                       "(a crashed train stage then restarts from step 0 instead of its last checkpoint)")
    prune.add_argument("--dry-run", action="store_true", help="list what would be removed")
    add("ui", "Print the commands that open the MLflow and Prefect UIs on this run's stores.", cmd_ui)
    add("continuous-eval", "Evaluate the training checkpoints that are due and not yet evaluated, and log "
        "their scores to MLflow at their step (the continuous-eval deployment runs this on a schedule).",
        cmd_continuous_eval)
    sub.add_parser("eval", add_help=False, help="lm-eval's own CLI with Kiln's model registered: kiln eval --model kiln "
                   "--model_args model_dir=DIR,tokenizer=FILE --tasks ... (any lm_eval flag; kiln eval --help lists them)")
    add("dedup-batch", "Deduplicate a new batch of documents against the dedup stage's persisted LSH index (no old "
        "signature is recomputed); the result is a store entry of stage dedup-batch with its manifest and MLflow run.",
        cmd_dedup_batch, first=("batch", "new documents: a folder of shards (.jsonl.zst, .jsonl) or one file"))
    research = add("research", "Test model and objective variants (the config's research section) against the "
                   "baseline at several proxy sizes and seeds; print the decision table (promote, reject, "
                   "inconclusive, crossover) with each variant's costs.", cmd_research)
    research.add_argument("--promote", metavar="NAME", help="write the production config with this promoted variant "
                          "applied, as a new file beside CONFIG (printed)")
    export = add("export", "Write a model as a Hugging Face folder (config.json, model.safetensors, tokenizer, model card) "
                 "that transformers and `lm_eval --model hf` load.", cmd_export,
                 first=("source", "a stage name (this config's output of it, e.g. anneal), a stage key, or a model "
                        "folder or checkpoints/step_N folder"))
    export.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")
    export.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json (default: the source's tokenize input, "
                        "else this config's tokenize output)")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    servers_args = "a config file or work_dir=DIR: only its work_dir is used"
    up = add("up", "Start a local Prefect server and MLflow tracking server (127.0.0.1; their records in SQLite "
             "under work_dir/servers, in a PostgreSQL of Kiln's own with --database postgres, or in your database "
             "given by URL), wait until both are healthy, and write work_dir/servers/env for `source`; beside them, "
             "a reaper (kiln reap --every 30s) marks what a crash left running. Servers of an earlier `up` that "
             "died are started again as they were.", cmd_up, args_help=servers_args)
    up.add_argument("--database", choices=["sqlite", "postgres"], default=os.environ.get("KILN_DATABASE"),
                    help="postgres: a local PostgreSQL cluster under work_dir/servers/postgres (created on first use; "
                         "Debian's postgresql package), for many concurrent runs; sqlite: the embedded default "
                         "(default: $KILN_DATABASE, else postgres where this work dir has a cluster, else sqlite)")
    up.add_argument("--prefect-port", type=int, default=None,
                    help="the Prefect server and UI's port (default: the last `kiln up` here's, else 4200)")
    up.add_argument("--mlflow-port", type=int, default=None,
                    help="the MLflow server and UI's port (default: the last `kiln up` here's, else 5000)")
    up.add_argument("--prefect-database", default=os.environ.get("KILN_PREFECT_DATABASE"), metavar="URL",
                    help="e.g. postgresql+asyncpg://user:pass@host/prefect (default: $KILN_PREFECT_DATABASE, else SQLite)")
    up.add_argument("--mlflow-database", default=os.environ.get("KILN_MLFLOW_DATABASE"), metavar="URL",
                    help="e.g. postgresql://user:pass@host/mlflow (default: $KILN_MLFLOW_DATABASE, else SQLite)")
    reap = add("reap", "Mark what a crash left running (a worker or machine killed, no worker started since): "
               "MLflow runs RUNNING whose process died, or whose Prefect flow run ended, FAILED, and Prefect task runs "
               "Running in an ended flow run Crashed, each with the reason; prints each. `kiln up` starts one with "
               f"--every {REAP_EVERY_S}s beside its servers; `kiln status` lists what it would mark.", cmd_reap)
    reap.add_argument("--every", metavar="DURATION", help="keep reaping at this interval (30s, 1m) until stopped "
                      "(needs a Prefect server: PREFECT_API_URL)")
    add("down", "Stop the servers `kiln up` started for a working directory, their workers and reaper (Kiln's "
        "PostgreSQL last; its cluster is kept): the one given (--work-dir), else this folder's, else the last `kiln up`'s, wherever it was; names "
        "the others still running.", cmd_down,
        args_help=servers_args)
    slurm = add("slurm", "Start, stop or show a local Slurm cluster (this machine's slurmctld and slurmd, in "
                "work_dir/slurm) for trying cluster.launcher=slurm and cluster.executor=slurm; up and status print "
                "the one line to run: export SLURM_CONF=...", cmd_slurm, first=("action", "up, down or status"),
                args_help=servers_args)
    slurm.add_argument("--nodes", type=int, default=1, help="with up: emulated nodes, one slurmd each (default 1: "
                       "this host; 2 or more: kiln-n1, kiln-n2, ... so that jobs span nodes and --exclude moves them)")
    slurm.add_argument("--cpus", type=int, help="with up: CPUs per node (default: this machine's)")
    for name, func, help_text in (
        ("deploy", cmd_deploy, "Register every deployment (pipeline, each stage, continuous eval) with the Prefect "
                               "server at PREFECT_API_URL, creating its work pool (process, or --work-pool kubernetes) "
                               "if needed. Flow runs start in this folder: config paths, data paths and work_dir "
                               "resolve here, wherever Kiln is installed."),
        ("serve", cmd_serve, "Serve the pipeline and every stage (and continuous eval, given a config) from this "
                             "process: deployments without a worker, for a laptop."),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--continuous-eval", metavar="CONFIG.yaml",
                       help="schedule continuous eval on this config (the training's), every continuous_eval.interval "
                            "of it (default 10m); it pauses itself once train and anneal are complete and scored. "
                            "No schedule when not given")
        p.add_argument("--every", metavar="DURATION",
                       help="with --continuous-eval: the schedule's interval (60s, 10m, 1h), i.e. the override "
                            "continuous_eval.interval=DURATION")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for the continuous-eval config")
        _work_dir_option(p)
        p.set_defaults(func=func)
        if name == "deploy":
            p.add_argument("--work-pool", choices=["process", "kubernetes"], default="process",
                           help="where flow runs run: local processes started by `kiln worker` (default), or pods "
                                "of the kiln-kubernetes pool (infra/work-pools/kubernetes.json); every deployment "
                                "moves to that pool")
            p.add_argument("--image", default=os.environ.get("KILN_IMAGE"),
                           help="with --work-pool kubernetes: the flow-run image, Kiln's (infra/container/Dockerfile: Kiln, "
                                "kubectl, the project folder /opt/kiln) (default: $KILN_IMAGE)")
            p.add_argument("--alert-webhook", metavar="URL", default=os.environ.get("KILN_ALERT_WEBHOOK"),
                           help="post alerts (failed stage, training rollback/abort, crashed run) to this "
                                "Slack-compatible webhook (default: $KILN_ALERT_WEBHOOK; none: no alerts)")
    worker_help = ("Start a Prefect worker for Kiln's work pool (kiln-process), with the process settings CLI runs "
                   "get; its flow runs start in the folder `kiln deploy` ran in.")
    worker = sub.add_parser("worker", help=worker_help, description=worker_help)
    worker.set_defaults(func=cmd_worker)
    plan = sub.add_parser("plan", help="Pick dp x tp x pp x cp, micro-batch and checkpointing for a model on a cluster.",
                          description="Estimate memory and step time of every parallel layout; reject what does not "
                                      "fit, rank the rest, explain the choice.")
    plan.add_argument("config", nargs="?", help="a Kiln config: plan its train stage (model, run.seq_len, the global "
                      "batch run.batch_size, its cluster section, tokenize.vocab_size) as `train.parallel: auto` does")
    plan.add_argument("overrides", nargs="*", help="key=value overrides of CONFIG")
    _work_dir_option(plan)
    plan.add_argument("--model", help="a configs/models preset (7b, 70b, ...) or a ModelConfig .yaml "
                      "(with CONFIG: replaces train.model)")
    plan.add_argument("--cluster", help="a configs/clusters preset (h100-1node, ...) or a .yaml "
                      "(with CONFIG: replaces its cluster section)")
    plan.add_argument("--seq-len", type=int, help="default: the model's max_seq_len")
    plan.add_argument("--vocab-size", type=int, help="default: the model preset's vocab_size (32000 if it names none)")
    batch = plan.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-seqs", type=int, help="sequences per optimizer step")
    batch.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (a multiple of --seq-len; "
                       "default 4194304, Llama 3's first batches)")
    plan.add_argument("--precision", choices=["bf16-mixed", "fp32"], default="bf16-mixed")
    plan.add_argument("--json", action="store_true", help="print the search summary as JSON instead of the report")
    plan.add_argument("--verify", action="store_true", help="build the chosen layout for real on torch's fake process "
                      "group and compare each rank's parameter, gradient and optimizer bytes and one training step's "
                      "peak memory with the planner's; exit 1 if they disagree")
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=float, metavar="FLOPS", help="instead: the compute-optimal run (N, D, "
                        "shape, steps, LR, batch, predicted loss) for this many FLOPs, from CONFIG's completed fit")
    budget.add_argument("--hours", type=float, help="as --budget, for every accelerator of the cluster for this "
                        "many hours at its assumed MFU")
    plan.set_defaults(func=cmd_plan)
    return parser


# commands that read no Kiln config, so neither --work-dir nor key=value means anything to them
NO_CONFIG_COMMANDS = ("init", "image", "worker", "eval")


def _work_dir_option(p: argparse.ArgumentParser) -> None:
    """`--work-dir DIR`, the same in every command that reads a config: the override `work_dir=DIR`."""
    p.add_argument("--work-dir", help="working directory for the store, MLflow and Prefect (the override work_dir=DIR)")


def _parse_intermixed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parses overrides and options in any order (`kiln run CONFIG --work-dir DIR key=value`). argparse gives a
    `nargs="*"` positional only the first run of positionals; `parse_intermixed_args` refuses subcommands, so
    the positionals after an option come back unrecognized and join the command's overrides, in order."""
    ns, extras = parser.parse_known_args(argv)
    trailing = next((name for name in ("args", "overrides") if isinstance(getattr(ns, name, None), list)), None)
    if extras and (trailing is None or any(arg.startswith("-") for arg in extras)):
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if extras:
        getattr(ns, trailing).extend(extras)
    if "=" in (getattr(ns, "config", None) or ""):  # `kiln plan key=value`: an override, not a config file
        ns.overrides.insert(0, ns.config)
        ns.config = None
    if getattr(ns, "work_dir", None) and isinstance(getattr(ns, "overrides", None), list):
        ns.overrides.append(f"work_dir={ns.work_dir}")  # the commands with `args` add it when they load (`_load`)
    return ns


def main(argv: list[str] | None = None) -> int:
    """Run the command in `argv`; None: this process's own command line (the `kiln` script), which ends after it."""
    parser = build_parser()
    process_ends = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # the rest is lm-eval's command line, its flags unknown to this parser
        ns = argparse.Namespace(func=cmd_eval, lm_eval_args=argv[1:])
    else:
        ns = _parse_intermixed(parser, argv)
    try:
        return ns.func(ns)
    except KilnError as error:
        print(f"kiln: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted; completed stages are kept and the next run resumes after them", file=sys.stderr)
        return 130
    except Exception as error:
        if _error_id(error) in _ECHO.echoed:  # Prefect's echo of the task run showed it
            print(f"kiln: failed: {type(error).__name__}: {error}", file=sys.stderr)
        else:
            traceback.print_exc()
        print("kiln: failed (traceback above). Completed stages are kept; fix the cause and rerun.", file=sys.stderr)
        return 1
    finally:
        if process_ends:
            # its objects (Prefect, MLflow, pandas: millions) are left to the OS, not to the collector's
            # passes over them at interpreter exit: 2.5-3 s of a cached rerun (benchmarks/pipeline_rerun.py)
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
