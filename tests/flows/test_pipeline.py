"""The whole pipeline through the real CLI, Prefect API, MLflow store, datatrove, fastText,
torch and lm-eval, on the tiny config: end to end, cached rerun, and resume after a failure."""

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kiln.flows.cli import main
from kiln.tasks.config import load_config
from kiln.tasks.graph import stage_keys
from kiln.tasks.stages import REGISTRY
from kiln.tasks.store import MANIFEST_FILE, Store
from tests.fixtures import toy_stage
from tests.processes import kill_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the whole pipeline, then cached: 80 s measured on 2 busy cores
STAGE_NAMES = REGISTRY.pipeline()
TINY = "configs/tiny.yaml"
REPO = Path(__file__).resolve().parents[2]
DATA_STAGES = ("collect", "clean", "dedup", "decontaminate")


def output_digests(store: Store, keys: dict[str, str]) -> dict[str, str]:
    """Hash of every output file of every stage (the manifest aside), to prove reruns change nothing."""
    digests = {}
    for stage, key in keys.items():
        root = store.path(stage, key)
        for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
            digests[str(path.relative_to(store.root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def stop_train_after_checkpoint(partial: Path, step: int, args: list[str]) -> int:
    """Run `kiln stage train ARGS` in a subprocess and SIGKILL it, torchrun and its workers included,
    as soon as the checkpoint of `step` is complete in the stage's partial folder (as a lost node
    would); returns the newest complete checkpoint's step."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.flows.cli", "stage", "train", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    marker = partial / "checkpoints" / f"step_{step:07d}" / "COMPLETE"
    deadline = time.monotonic() + 300
    try:
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"the train stage ended before its step-{step} checkpoint: {proc.stderr.read()[-2000:]}"
        assert marker.exists(), f"the train stage (pid {proc.pid}) completed no step-{step} checkpoint ({marker}) in 300 s"
    finally:
        kill_tree(proc.pid)
        proc.wait()
    done = [int(p.parent.name.split("_")[1]) for p in (partial / "checkpoints").glob("step_*/COMPLETE")]
    return max(done)


def stage_statuses(client: MlflowClient, parent_id: str) -> dict[str, str]:
    runs = client.search_runs(
        [client.get_experiment_by_name("kiln").experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
    )
    return {r.data.tags["kiln.stage"]: r.data.tags["kiln.status"] for r in runs}


def latest_pipeline_run(client: MlflowClient):
    runs = client.search_runs([client.get_experiment_by_name("kiln").experiment_id],
                              filter_string="tags.`kiln.stage` = 'pipeline'", order_by=["attributes.start_time DESC"])
    return runs[0]


def test_pipeline_end_to_end_then_fully_cached(prefect_api, in_repo, tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["run", TINY, f"work_dir={work}"]) == 0
    out = capsys.readouterr().out
    assert all(stage in out for stage in STAGE_NAMES) and "mlflow ui --backend-store-uri" in out

    cfg = load_config(TINY, [f"work_dir={work}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    manifests = {s: store.manifest(s, keys[s]) for s in STAGE_NAMES}

    # Every data stage accounts for every document, and each stage reads what the one before kept.
    for stage in DATA_STAGES:
        stats = manifests[stage]["stats"]
        assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    for before, after in zip(DATA_STAGES, DATA_STAGES[1:]):
        assert manifests[after]["stats"]["num_in"] == manifests[before]["stats"]["num_kept"]
    assert manifests["tokenize"]["stats"]["num_in"] == manifests["decontaminate"]["stats"]["num_kept"]
    assert manifests["collect"]["stats"]["num_kept"] > 100
    assert set(manifests["clean"]["stats"]["languages"]) >= {"en", "cs", "da"}

    # Training learned, annealing ended at LR 0 and evaluation produced finite scores.
    train = manifests["train"]["stats"]
    curve = json.loads((store.path("train", keys["train"]) / "metrics.json").read_text())["loss_curve"]
    assert curve[-1][1] < curve[0][1]
    anneal_lr = json.loads((store.path("anneal", keys["anneal"]) / "metrics.json").read_text())["lr_curve"]
    assert anneal_lr[-1][1] == 0.0
    evaluate = manifests["evaluate"]["stats"]["metrics"]
    assert 0 < evaluate["anneal"]["kiln_heldout/bits_per_byte"] < 20
    # The contamination rate of each eval task is recorded beside its score: the share of the items it
    # scored (tiny.yaml: evaluate.limit=10) drawn from eval documents the decontaminate stage found.
    rates = json.loads((store.path("decontaminate", keys["decontaminate"]) / "contamination_rates.json").read_text())
    found = json.loads((store.path("decontaminate", keys["decontaminate"]) / "contamination.json").read_text())
    leaked = set(found["benchmarks"]["heldout"]["contaminated_eval_docs"])
    scored = [json.loads(line)["id"] for line in Path(cfg.evaluate.eval_files[0]).read_text().splitlines()][:cfg.evaluate.limit]
    assert evaluate["anneal"]["kiln_heldout/contamination_rate"] == sum(i in leaked for i in scored) / len(scored)
    assert 0 < rates["kiln_heldout"] == len(leaked) / 63 <= 1
    # A multiple-choice and a perplexity score per domain before and after annealing, in one report table;
    # the run ends by scoring the kept train and anneal checkpoints and drawing the ECG.
    for model in ("train", "anneal"):
        assert 0 <= evaluate[model]["kiln_heldout_choice/acc_norm"] <= 1 < evaluate[model]["kiln_heldout_code/bits_per_byte"]
    report = (store.path("evaluate", keys["evaluate"]) / "report.md").read_text()
    assert "| kiln_heldout_choice | mid | acc_norm ↑ |" in report and "anneal − train" in report
    # The anneal decayed 1-sqrt from the final model with the best fifth of web and prose by quality score in
    # its mixture; the ablation ran two short anneals from the step-20 checkpoint, ranked, a report column each.
    anneal = manifests["anneal"]["stats"]
    assert (anneal["schedule"], anneal["from_step"]) == ("1-sqrt", 40) and anneal["quality_selections"]["best"]["num_selected"] > 0
    ablation = manifests["anneal-ablation"]["stats"]
    assert ablation["from_step"] == 20 and set(ablation["ranking"]) == {"prose", "best"} and ablation["best"] in ablation["ranking"]
    assert "ablation/prose − train" in report and "ablation/best − train" in report
    assert (work / "continuous_eval" / keys["train"] / "ecg.png").read_bytes()[:4] == b"\x89PNG"
    assert train["val_loss"] > 0 and manifests["validate"]["stats"]["gate_passed"] is True
    # The gate scored the mid-scale model and the best proxy of each of tiny's 2 budgets on the eval suite:
    # one row per task's primary metric, bits per byte gated, the rest shown as trends.
    gate = manifests["validate"]["stats"]["gate"]
    assert gate["checks"]["capabilities_continue"] is True and gate["mixture_transfer"] is None
    assert [(r["metric"], r["gated"], len(r["proxies"])) for r in gate["capabilities"]] == [
        ("kiln_heldout/bits_per_byte", True, 2), ("kiln_heldout_choice/acc_norm", False, 2),
        ("kiln_heldout_code/bits_per_byte", True, 2), ("kiln_heldout_code_choice/acc_norm", False, 2),
        ("kiln_heldout_code_lines/exact_match", False, 2)]
    # Cost: every manifest prices its stage; on CPU no accelerator-seconds are spent.
    assert all(m["cost"]["wall_s"] > 0 and m["cost"]["cpu_s"] >= 0 for m in manifests.values())
    assert (train["num_accelerators"], manifests["train"]["cost"]["accelerator_s"]) == (0, 0)

    # MLflow: one parent run, a child per stage with the stage key as input digest, trials as grandchildren.
    client = MlflowClient(cfg.tracking_uri)
    parent = latest_pipeline_run(client)
    assert stage_statuses(client, parent.info.run_id) == {s: "ran" for s in STAGE_NAMES}
    clean_run = client.get_run(manifests["clean"]["mlflow_run_id"])
    assert clean_run.data.tags["kiln.key"] == keys["clean"]
    assert [d.dataset.digest for d in clean_run.inputs.dataset_inputs] == [keys["collect"]]
    assert clean_run.data.params["clean.languages"] == json.dumps(cfg.clean.languages)
    trials = client.search_runs([parent.info.experiment_id],
                                filter_string=f"tags.mlflow.parentRunId = '{manifests['sweep']['mlflow_run_id']}'")
    assert len(trials) == manifests["sweep"]["stats"]["num_trials"]

    # A batch delivered again later is deduplicated against the persisted index: nothing new survives.
    redelivered = store.path("clean", keys["clean"])  # a folder of shards
    assert main(["dedup-batch", str(redelivered), TINY, f"work_dir={work}"]) == 0
    batch_key = stage_keys(load_config(TINY, [f"work_dir={work}", f"dedup_batch.batch={redelivered.resolve()}"]))
    batch = store.manifest("dedup-batch", batch_key["dedup-batch"])  # a store entry, with its manifest
    assert (batch["stats"]["num_in"], batch["stats"]["num_kept"]) == (manifests["clean"]["stats"]["num_kept"], 0)
    assert client.get_run(batch["mlflow_run_id"]).data.tags["kiln.stage"] == "dedup-batch"
    assert str(store.path("dedup-batch", batch_key["dedup-batch"])) in capsys.readouterr().out

    # Layouts are runtime, the global batch is science: the train stage stopped (killed) just after its
    # step-20 checkpoint while running as FSDP2 over 2 torchrun processes, then rerun as one process
    # with 2 micro-batches per step, resumes at step 20 under the same key, sees the same global
    # batches, and ends within float tolerance of the uninterrupted single-process run.
    reference = json.loads((store.path("train", keys["train"]) / "metrics.json").read_text())
    shutil.move(store.path("train", keys["train"]), tmp_path / "train-reference")
    killed_at = stop_train_after_checkpoint(store.partial_path("train", keys["train"]), 20,
                                            [TINY, f"work_dir={work}", "train.parallel.dp=2"])
    assert killed_at == 20
    assert main(["stage", "train", TINY, f"work_dir={work}", "train.run.grad_accum=2"]) == 0
    assert stage_keys(load_config(TINY, [f"work_dir={work}", "train.parallel.dp=2", "train.run.grad_accum=2"])) == keys
    resumed = json.loads((store.path("train", keys["train"]) / "metrics.json").read_text())
    assert resumed["resumed_from_step"] == 20 and store.manifest("train", keys["train"])["stats"]["resumed_from_step"] == 20
    assert resumed["batch_checksum_curve"] == reference["batch_checksum_curve"]
    assert [s for s, _ in resumed["loss_curve"]] == [s for s, _ in curve]
    # summation-order differences (FSDP's reduction, then 2 micro-batches) start at 1e-7 and grow
    # over 40 steps at this LR to a few 1e-3 (measured up to 1.5e-5 by step 10 and 3.6e-3 by step 40;
    # each fresh run's corpus differs slightly, since the quality classifier's training is threaded)
    relative = [abs(a - b) / b for (_, a), (_, b) in zip(resumed["loss_curve"], curve)]
    assert max(relative[:10]) < 1e-4 and max(relative) < 1e-2
    assert (store.path("train", keys["train"]) / "model" / "model.pt").is_file()
    capsys.readouterr()

    # The second run reuses everything and changes nothing.
    before = output_digests(store, keys)
    assert main(["run", TINY, f"work_dir={work}"]) == 0
    assert output_digests(store, keys) == before
    parent = latest_pipeline_run(client)
    assert stage_statuses(client, parent.info.run_id) == {s: "cached" for s in STAGE_NAMES}
    assert f"{len(STAGE_NAMES)} stages ({len(STAGE_NAMES)} cached)" in capsys.readouterr().out

    # A new stage is one module and one registry entry: registered, it runs through the pipeline
    # flow behind the cached stages, with its config section, store entry and MLflow run.
    REGISTRY.register(toy_stage.STAGE)
    try:
        assert main(["run", TINY, f"work_dir={work}", "toy_count.min_chars=500"]) == 0
        assert f"{len(STAGE_NAMES) + 1} stages ({len(STAGE_NAMES)} cached)" in capsys.readouterr().out
        statuses = stage_statuses(client, latest_pipeline_run(client).info.run_id)
        assert statuses == {**{s: "cached" for s in STAGE_NAMES}, "toy-count": "ran"}
        toy_cfg = load_config(TINY, [f"work_dir={work}", "toy_count.min_chars=500"])
        assert store.manifest("toy-count", stage_keys(toy_cfg)["toy-count"])["stats"]["num_long"] > 0
    finally:
        REGISTRY.unregister(toy_stage.STAGE.name)


def test_failed_stage_then_rerun_redoes_only_it_and_what_follows(prefect_api, in_repo, tmp_path, capsys):
    work = tmp_path / "work"
    missing = tmp_path / "no-such-eval.jsonl"
    # The eval suite file is missing: decontaminate (the first stage that reads it) must fail clearly.
    assert main(["run", TINY, f"work_dir={work}", f"evaluate.eval_files=[{missing}]", "--until", "tokenize"]) == 2
    err = capsys.readouterr().err
    assert f"eval file {missing} does not exist (config key evaluate.eval_files[0])" in err
    cfg = load_config(TINY, [f"work_dir={work}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    assert [s for s in DATA_STAGES if store.is_complete(s, keys[s])] == ["collect", "clean", "dedup"]

    assert main(["run", TINY, f"work_dir={work}", "--until", "tokenize"]) == 0
    client = MlflowClient(cfg.tracking_uri)
    statuses = stage_statuses(client, latest_pipeline_run(client).info.run_id)
    assert statuses == {"collect": "cached", "clean": "cached", "dedup": "cached",
                        "decontaminate": "ran", "tokenize": "ran"}
    assert "docs_in=" in capsys.readouterr().out


def test_stage_alone_needs_its_inputs(prefect_api, in_repo, tmp_path, capsys):
    assert main(["stage", "tokenize", TINY, f"work_dir={tmp_path}"]) == 2
    assert "stage tokenize needs decontaminate first" in capsys.readouterr().err


def test_missing_source_path_is_a_clear_error(prefect_api, in_repo, tmp_path, capsys):
    # records may be of every domain the tiny config names, as the sources it replaces are
    override = (f"collect.sources=[{{name: web, path: {tmp_path}/absent, format: jsonl, domain: web, "
                "domain_field: domain, domains: [code, prose, multilingual]}]")
    assert main(["run", TINY, f"work_dir={tmp_path}", override, "clean.quality_training.positive_sources=[]",
                 "--until", "collect"]) == 2
    err = capsys.readouterr().err
    assert "absent" in err and "collect.sources[0].path" in err
