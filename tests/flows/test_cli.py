"""The `kiln` CLI without running stages: help, config, status, plan, and argument errors."""

import pytest

from kiln.flows.cli import main
from kiln.tasks.stages import REGISTRY


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "stage", "config", "status", "ui", "plan"):
        assert command in out
    assert "collect → clean → dedup" in out
    # configs/default.yaml is the whole default run on the bundled corpus; tiny.yaml is the small one
    assert "tiny pipeline (configs/default.yaml)" not in out and "configs/tiny.yaml" in out
    assert "kiln worker" in out and "prefect worker start" not in out


def test_config_prints_resolved_values_and_keys(in_repo, capsys):
    assert main(["config", "configs/tiny.yaml", "dedup.threshold=0.75", "--keys"]) == 0
    out = capsys.readouterr().out
    assert "threshold: 0.75" in out and "# stage keys" in out and "evaluate:" in out


def test_status_lists_every_stage_as_missing_in_a_fresh_work_dir(in_repo, tmp_path, capsys):
    assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.count("missing") == len(REGISTRY.pipeline())
    assert "dedup-batch" not in out  # on demand (kiln dedup-batch): the pipeline owes it nothing


def test_status_rows_are_aligned_cut_to_the_terminal_and_say_why_a_stage_failed(in_repo, tmp_path, capsys,
                                                                                monkeypatch):
    from kiln.tasks.config import load_config
    from kiln.tasks.errors import InputError
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.runner import run_stage
    from kiln.tasks.store import Store

    monkeypatch.setenv("COLUMNS", "120")
    missing_eval = "evaluate.eval_files=[nowhere/eval.jsonl]"
    args = ["status", "configs/tiny.yaml", f"work_dir={tmp_path}", missing_eval]
    cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}", missing_eval])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    headline = {f"model_{i}/kiln_heldout/bits_per_byte": 3.5 + i for i in range(20)}  # evaluate's is this long
    for stage in ("dedup", "anneal-ablation", "evaluate"):
        store.begin(stage, keys[stage])
        store.commit(stage, keys[stage], {"stats": {"headline": headline}, "wall_s": 1.0, "cost": {}})
    with pytest.raises(InputError):  # a data error: the eval file the config names is not there
        run_stage("decontaminate", cfg, keys=keys)
    store.begin("sweep", keys["sweep"])  # an attempt that died without a word
    assert main(args) == 0
    stages = capsys.readouterr().out.split("\ncontinuous eval")[0]  # the stage rows, then continuous eval's
    rows = {line.split()[0]: line for line in stages.splitlines() if line.startswith("  ")}
    assert {len(row) - len(row.split(maxsplit=1)[1]) for row in rows.values()} == {2 + len("anneal-ablation") + 1}
    assert all(len(row) <= 120 for row in rows.values())
    assert rows["evaluate"].endswith("more") and "model_0/kiln_heldout/bits_per_byte=3.5" in rows["evaluate"]
    assert "failed (fix it, then rerun): InputError: eval file nowhere/eval.jsonl does not exist" in rows["decontaminate"]
    assert rows["decontaminate"].endswith("...")  # cut to fit
    assert rows["sweep"].split(maxsplit=2)[2].startswith("partial (an attempt crashed")


def test_status_shows_where_a_running_training_stage_is(in_repo, tmp_path, capsys):
    """Issue 33: `kiln status` shows a running train stage's live step, from the end of the metrics log its
    rank 0 appends (a long log is read from its end; the line being written is left out)."""
    import json

    from kiln.tasks.config import load_config
    from kiln.tasks.constants import METRICS_LOG
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.store import Store

    cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    store.begin("train", keys["train"])
    rows = "".join(json.dumps({"step": step, "loss": 9.0 - step / 100, "lr": 1e-3}) + "\n" for step in range(1, 401))
    assert len(rows) > 2 * 8192  # longer than the tail status reads
    (store.partial_path("train", keys["train"]) / METRICS_LOG).write_text(rows + '{"step": 401, "lo')
    with store.lock("train", keys["train"]):
        assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["train"])
    assert "running at step 400 (loss 5.0000, " in row and "s ago) (held by " in row
    store.begin("anneal", keys["anneal"])  # running, but no step logged yet
    with store.lock("anneal", keys["anneal"]):
        assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["anneal"])
    assert "running (held by " in row


def test_overrides_and_options_come_in_any_order(in_repo, tmp_path, capsys):
    assert main(["config", "configs/tiny.yaml", "--keys", "dedup.threshold=0.75", f"--work-dir={tmp_path}",
                 "train.run.eval_batches=3"]) == 0
    out = capsys.readouterr().out
    assert "threshold: 0.75" in out and "eval_batches: 3" in out and f"work_dir: {tmp_path}" in out and "# stage keys" in out
    # later overrides win, whichever side of an option they stand on
    assert main(["config", "dedup.threshold=0.5", "--work-dir", str(tmp_path), "configs/tiny.yaml",
                 "dedup.threshold=0.75"]) == 0
    assert "threshold: 0.75" in capsys.readouterr().out
    assert main(["status", "configs/tiny.yaml", "--work-dir", str(tmp_path), "evaluate.eval_files=[]"]) == 0
    assert "missing" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # an unknown option after an override is still refused
        main(["config", "configs/tiny.yaml", "dedup.threshold=0.75", "--nope", "train.run.steps=12"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes no stray positional
        main(["worker", "dedup.threshold=0.75"])


def test_status_says_where_each_training_run_ran(in_repo, tmp_path, capsys):
    from kiln.tasks.config import load_config
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.launch.cluster import launch_record
    from kiln.tasks.store import Store

    cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    relaunched = launch_record("slurm", "kiln-train-0123", [
        {"attempt": 1, "job_id": "7", "nodes": ["kiln-n1"], "failed": "ended FAILED", "failed_hosts": ["kiln-n1"]},
        {"attempt": 2, "job_id": "8", "nodes": ["kiln-n2"], "excluded": ["kiln-n1"], "time_to_resume_s": 6.25}], 40.0)
    store.begin("train", keys["train"])
    store.commit("train", keys["train"], {"stats": {}, "wall_s": 1.0, "cost": {},
                                          "launch": {"launcher": "slurm", "runs": {"train": relaunched}}})
    assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["train"])
    assert lines[row + 1].split() == ["train:", "slurm", "job", "7,8", "(kiln-train-0123)", "on", "kiln-n1,kiln-n2;",
                                      "attempt", "1", "failed", "on", "kiln-n1,", "resumed", "in", "6.2", "s"]


def test_bad_arguments_and_config_errors_exit_2_without_traceback(in_repo, capsys):
    assert main(["config", "not-a-config"]) == 2
    assert "neither a config file" in capsys.readouterr().err
    assert main(["config", "train.run.steps=many"]) == 2
    err = capsys.readouterr().err
    assert "train.run.steps" in err and "Traceback" not in err


def test_plan_picks_fsdp_for_7b_on_one_h100_node(in_repo, capsys):
    assert main(["plan", "--model", "7b", "--cluster", "h100-1node", "--seq-len", "4096",
                 "--global-batch-tokens", "4194304"]) == 0
    assert "Chosen: dp=8 tp=1 pp=1 cp=1" in capsys.readouterr().out


def test_plan_of_a_config_prices_its_long_context_phase_and_suggests_context_parallelism(in_repo, capsys):
    phases = ("train.phases=[{name: short, until_step: 30}, {name: long, seq_len: 262144, rope_scaling: "
              "{kind: yarn, factor: 32, original_max_seq_len: 8192}}]")
    assert main(["plan", "configs/tiny.yaml", "--model", "8b", "--cluster", "h100-1node", "train.run.seq_len=8192",
                 "train.run.batch_size=8", phases]) == 0
    out = capsys.readouterr().out
    assert "Chosen: dp=8 tp=1 pp=1 cp=1" in out  # the run's 8192-token sequences fit unsplit
    assert "Data phases at another sequence length:\n  phase 'long': 8 sequences of 262,144 tokens" in out
    assert ("A rank cannot hold one 262,144-token sequence (no layout with cp=1 fits): use context parallelism, "
            "cp=8") in out


def test_plan_explains_when_nothing_fits(in_repo, capsys):
    assert main(["plan", "--model", "70b", "--cluster", "h100-1node", "--seq-len", "4096",
                 "--global-batch-seqs", "1024"]) == 1
    assert "do not" in capsys.readouterr().out


def test_status_lists_abandoned_partial_folders_and_prune_removes_them(in_repo, tmp_path, capsys):
    from kiln.tasks.config import load_config
    from kiln.tasks.store import Store

    store = Store(load_config("configs/tiny.yaml", [f"work_dir={tmp_path}"]).store_root)
    (store.begin("decontaminate", "0ld0ld0ld0ld") / "document_shards.json").write_text("{}\n")
    assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    assert "1 abandoned partial folder(s)" in capsys.readouterr().out
    assert main(["prune", "configs/tiny.yaml", f"work_dir={tmp_path}", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and store.partial_folders()
    assert main(["prune", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    assert store.partial_folders() == [] and "1 partial folder(s)" in capsys.readouterr().out


def test_status_totals_the_cost_recorded_in_the_manifests(in_repo, tmp_path, capsys):
    from kiln.tasks.config import load_config
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.store import Store

    cfg = load_config("configs/tiny.yaml", [f"work_dir={tmp_path}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    for stage, wall in (("collect", 30.0), ("clean", 12.0)):
        store.begin(stage, keys[stage])
        store.commit(stage, keys[stage], {"stats": {}, "wall_s": wall, "cost": {
            "wall_s": wall, "cpu_s": 2 * wall, "peak_rss_mb": wall * 10, "accelerator_s": 3600 * wall / 6}})
    assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "cost of this pipeline's complete stages: 42 s wall, 84 s CPU, 7.00 accelerator-hours, peak memory 300 MiB" in out

    # a training stage brings the planner's forecast: its device-hours beside the spent ones, totalled
    store.begin("train", keys["train"])
    store.commit("train", keys["train"], {"stats": {"headline": {"device_h": 2.0, "forecast_device_h": 1.5}},
                                          "wall_s": 900.0, "cost": {
        "wall_s": 900.0, "cpu_s": 100.0, "peak_rss_mb": 500.0, "accelerator_s": 7200.0,
        "forecast_accelerator_s": 5400.0, "forecast_ratio": 7200.0 / 5400.0}})
    assert main(["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "device_h=2.0, forecast_device_h=1.5" in out
    assert ("cost of this pipeline's complete stages: 942 s wall, 184 s CPU, 9.00 accelerator-hours (the planner "
            "forecast 1.5 for its training stages), peak memory 500 MiB") in out


def test_a_run_failing_on_a_kiln_error_is_echoed_once_by_main_not_by_prefects_console():
    import logging

    from kiln.flows.cli import _KilnErrorEcho
    from kiln.tasks.scaling.validate import ValidationGateError

    def record(name: str, message: str, error: BaseException | None = None, level: int = logging.ERROR):
        exc_info = (type(error), error, None) if error is not None else None
        return logging.LogRecord(name, level, __file__, 1, message, None, exc_info)

    echo = _KilnErrorEcho()
    gate = ValidationGateError("production training refused: the validation gate failed")
    # Prefect's traceback and failed-state line of a user error: `main` prints it as `kiln: error: ...`
    assert not echo.filter(record("prefect.flow_runs", "Encountered exception during execution", gate))
    assert not echo.filter(record("prefect.task_runs", "Finished in state Failed('Task run encountered an exception "
                                  "ValidationGateError: production training refused')"))
    # anything else still reaches the console: unexpected errors, retries, other loggers, lower levels
    assert echo.filter(record("prefect.task_runs", "Task run failed with exception", RuntimeError("bug")))
    assert echo.filter(record("prefect.task_runs", "Finished in state Failed('Task run encountered an exception "
                              "RuntimeError: bug')"))
    assert echo.filter(record("kiln.tasks.train.loop", "a warning of Kiln's own", gate))
    assert echo.filter(record("prefect.flow_runs", "Finished in state Failed('Flow run encountered an exception: "
                              "ValidationGateError: x')", level=logging.INFO))


def test_down_for_a_work_dir_without_servers_names_those_that_have_them(tmp_path, monkeypatch, capsys):
    """`kiln up` records where it started servers (here: a record whose server is this live process);
    `kiln down` for another folder stops nothing and says where servers run."""
    import json
    import os

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    ops = tmp_path / "ops"
    (ops / "servers").mkdir(parents=True)
    (ops / "servers" / "servers.json").write_text(json.dumps([{
        "name": "prefect", "pid": os.getpid(), "url": "u", "ui": "u", "health": "u", "log": "l"}]))
    (tmp_path / "state" / "kiln").mkdir(parents=True)
    (tmp_path / "state" / "kiln" / "servers.json").write_text(json.dumps([str(ops), str(tmp_path / "gone")]))
    assert main(["down", "--work-dir", str(tmp_path / "elsewhere")]) == 0
    out = capsys.readouterr().out
    assert f"no kiln servers were running for {tmp_path / 'elsewhere'}" in out
    assert f"kiln servers still run for: {ops} (kiln down --work-dir {ops})" in out
    assert json.loads((tmp_path / "state" / "kiln" / "servers.json").read_text()) == [str(ops)]  # the dead dropped


def test_status_shows_continuous_eval_per_series(in_repo, tmp_path, capsys):
    """Scored, pending and missed checkpoints, open regressions and the ECG's path, from the store and the
    state files (no scoring here: tests/flows/test_continuous_eval.py scores real checkpoints)."""
    import json

    from kiln.tasks.config import load_config
    from kiln.tasks.continuous_state import ecg_path, eval_targets
    from kiln.tasks.evals.continuous import suite_versions
    from kiln.tasks.graph import stage_keys
    from kiln.tasks.store import Store
    from kiln.tasks.train.checkpoint import checkpoint_dir

    args = ["status", "configs/tiny.yaml", f"work_dir={tmp_path}"]
    cfg = load_config("configs/tiny.yaml", args[2:])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    assert main(args) == 0
    out = capsys.readouterr().out.split("\ncontinuous eval", 1)[1]
    assert f"(ECG {ecg_path(cfg, keys).resolve()}: not drawn yet)" in out
    assert f"  train   {keys['train']}  the stage has not started: nothing to score" in out

    # train is running: checkpoints 40 and 60 on disk (20 pruned unscored), 40 scored, 60 not yet
    (store.begin("tokenize", keys["tokenize"]) / "tokenizer.json").write_text("{}")
    store.commit("tokenize", keys["tokenize"], {"stats": {}, "wall_s": 1.0, "cost": {}})
    for step in (40, 60):
        checkpoint_dir(store.begin("train", keys["train"], resumable=True) / "checkpoints", step).mkdir(parents=True)
    train = eval_targets(cfg, keys)[0]
    train.state_dir.mkdir(parents=True)
    versions = suite_versions(train.evaluate)
    code = "kiln_heldout_code"  # bits per byte: 3.06 at step 20, 3.61 at step 40 (more than 5 % worse)
    rows = [{"step": step, "task": task, "version": version, "wall_s": 1.0,
             "metrics": {f"{task}/bits_per_byte": value, f"{task}/num_docs": 10}}
            for step, value in ((20, 3.06), (40, 3.61)) for task, version in versions.items() if task == code]
    rows += [{"step": step, "task": task, "version": version, "wall_s": 1.0, "metrics": {}}
             for step in (20, 40) for task, version in versions.items() if task != code]
    train.state_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ecg_path(cfg, keys).write_bytes(b"png")
    assert main(args) == 0
    out = capsys.readouterr().out.split("\ncontinuous eval", 1)[1]
    assert f"(ECG {ecg_path(cfg, keys).resolve()}):" in out
    assert (f"  train   {keys['train']}  scored 2 (20, 40), pending 1 (60), missed 0; open regressions: {code} "
            "bits_per_byte since step 40 (3.61 against its best 3.06 at step 20)") in out
    assert f"  anneal  {keys['anneal']}  the stage has not started" in out
    # Once the evaluate stage has judged the task not trusted, its regression is no longer an open one.
    trust_file = store.path("evaluate", keys["evaluate"]) / "trust.json"
    trust_file.parent.mkdir(parents=True)
    trust_file.write_text(json.dumps({code: {"trusted": False, "reasons": ["SNR 0.50 < 2.0"]}}))
    assert main(args) == 0
    assert "pending 1 (60), missed 0; open regressions: none" in capsys.readouterr().out
    trust_file.unlink()
    train.state_file.write_text("".join(json.dumps(row) + "\n" for row in rows if row["step"] == 40))
    assert main(args) == 0
    assert ("scored 1 (40), pending 1 (60), missed 1 (20) (pruned before scoring: train.run.keep_every keeps "
            "them); open regressions: none") in capsys.readouterr().out
