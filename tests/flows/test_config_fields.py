"""No setting is silently ignored: every field of the config tree is read by some code path.

The whole tiny pipeline and a continuous-eval pass run in this process with every attribute read
of a config section recorded, except reads made only to hash keys (`identity`, `stage_identity`):
a field that is hashed or validated but never used is exactly the bug this test exists for. Fields that only a
path not taken here reads are listed in ALLOWED with the reason and the test that covers them.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import pytest
from pydantic import BaseModel

import kiln.tasks.config
import kiln.tasks.graph
from kiln.flows.cli import main
from kiln.flows.continuous_eval import continuous_eval
from kiln.tasks.config import load_config
from kiln.tasks.configbase import Section

pytestmark = pytest.mark.slow
TINY = "configs/tiny.yaml"

# dotted path (list items as `[]`) -> why this run does not read it, and where it is exercised
_WSD = "read by schedule 'wsd' only: tests/tasks/train/test_train_schedule.py"
_ROLLBACK = "read when a loss anomaly rolls the run back: tests/tasks/train/test_train_health.py"
ALLOWED = {
    "dedup_batch": "the dedup-batch stage (`kiln dedup-batch`), outside the pipeline: tests/flows/test_pipeline.py",
    "dedup_batch.batch": "the dedup-batch stage (`kiln dedup-batch`), outside the pipeline: tests/flows/test_pipeline.py",
    **{name: "the batch stage (`kiln stage batch`), outside the pipeline: tests/flows/test_batches.py"
       for name in ("batch", "batch.name", "batch.sources")},
    "train.optim.decay_fraction": _WSD,
    "sweep.optim.decay_fraction": _WSD,
    **{f"cluster.{field}": "read by the torchrun launcher (train.parallel above one process, or cluster.launcher="
       "torchrun): the FSDP run in tests/flows/test_pipeline.py, tests/tasks/launch"
       for field in ("nodes", "gpus_per_node", "rdzv_port", "exclude_hosts", "max_restarts")},
    **{f"cluster.slurm{field}": "read by the Slurm launcher's script and the Slurm executor: "
       "tests/tasks/launch/test_slurm_settings.py (sbatch --test-only), tests/tasks/data/test_executors.py"
       for field in ("", ".account", ".qos", ".mem", ".constraint", ".gres", ".sbatch_lines", ".container_image",
                     ".container_mounts", ".modules", ".env", ".cpus_per_task")},
    "cluster.executor": "read by clean and dedup (tasks/data/executors.py): tests/tasks/data on Slurm and Ray",
    **{f"cluster.{field}": "read by the Slurm/Kubernetes launchers, the Slurm executor and the planner "
       "(train.parallel: auto): tests/tasks/launch, tests/tasks/data, tests/tasks/train/test_planner.py"
       for field in ("partition", "accelerator", "memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps",
                     "mfu", "reserved_gb", "time_limit", "image", "namespace")},
    **{f"collect.sources[].{field}": "read when an hf source loads a hub dataset (not a saved folder, as the "
       "bundled one is): tests/tasks/data/test_collect_sources.py"
       for field in ("config_name", "data_files", "revision")},
    "collect.sources[].domains": "read when a source sets domain_field: tests/tasks/data/test_collect_records.py, "
                                 "the own-data run in tests/flows/test_own_data.py",
    "clean.quality_training.references[].domains": "refused with domain_field on a reference: "
                                                   "tests/tasks/data/test_quality_training.py",
    "train.parallel.dp_mode": "read when dp > 1: tests/tasks/train/test_parallel.py, the FSDP run in test_pipeline.py",
    **{f"validate.mixture_transfer.{field}": "read when num_mixtures > 0, which tiny (no Dirichlet mixtures, no "
       "regression) turns off: the default run; min_spearman in tests/tasks/scaling/test_capabilities_and_transfer.py"
       for field in ("steps", "min_spearman")},
    **{f"{section}.run.health.{field}": _ROLLBACK for section in ("train", "sweep", "validate")
       for field in ("max_rollbacks", "rollback_lr_factor", "rollback_lr_steps")},
    **{f"research{field}": "the research stage (`kiln research CONFIG`), on demand, outside the pipeline: "
       "tests/tasks/scaling/test_research.py"
       for field in ("", ".variants", ".scales", ".seeds", ".lr_sweep", ".alpha", ".production_flops",
                     ".decode_tokens", ".max_parallel")},
    "continuous_eval.interval": "read by kiln deploy --continuous-eval and kiln serve (the schedule's interval): "
                                "tests/flows/test_infra.py, tests/flows/test_operate.py",
}

_hashing = ContextVar("hashing", default=False)


@contextmanager
def _not_recorded():
    token = _hashing.set(True)
    try:
        yield
    finally:
        _hashing.reset(token)


def _unrecorded(function):
    def wrapper(*args, **kwargs):
        with _not_recorded():
            return function(*args, **kwargs)
    return wrapper


def field_paths(section: Section, prefix: str = "") -> dict[str, tuple[type, str]]:
    """Every field under `section` as `dotted.path` -> (its section class, its name)."""
    paths: dict[str, tuple[type, str]] = {}
    for name, info in type(section).model_fields.items():
        path = f"{prefix}{info.alias or name}"
        paths[path] = (type(section), name)
        value = getattr(section, name)
        if isinstance(value, Section):
            paths.update(field_paths(value, f"{path}."))
        elif isinstance(value, (list, tuple, dict)):
            for item in value.values() if isinstance(value, dict) else value:
                if isinstance(item, Section):
                    paths.update(field_paths(item, f"{path}[]."))
    return paths


def test_every_config_field_is_read_by_the_pipeline(prefect_api, in_repo, tmp_path, monkeypatch):
    reads: set[tuple[type, str]] = set()
    plain_getattribute = Section.__getattribute__

    def recording_getattribute(self: Any, name: str) -> Any:
        if not _hashing.get() and name in type(self).model_fields:
            reads.add((type(self), name))
        return plain_getattribute(self, name)

    monkeypatch.setattr(Section, "__getattribute__", recording_getattribute)
    monkeypatch.setattr(Section, "identity", _unrecorded(Section.identity))
    monkeypatch.setattr(kiln.tasks.graph, "stage_identity", _unrecorded(kiln.tasks.graph.stage_identity))
    # validators read fields to check them, which is not using them; so do the checks of the names a config uses
    # and of the checkpoints it needs kept
    monkeypatch.setattr(kiln.tasks.config, "check_references", _unrecorded(kiln.tasks.config.check_references))
    monkeypatch.setattr(kiln.tasks.config, "check_kept_steps", _unrecorded(kiln.tasks.config.check_kept_steps))
    monkeypatch.setattr(Section, "__init__", _unrecorded(Section.__init__))
    validate = BaseModel.model_validate.__func__
    monkeypatch.setattr(BaseModel, "model_validate", classmethod(_unrecorded(validate)))

    overrides = [f"work_dir={tmp_path / 'work'}"]
    assert main(["run", TINY, *overrides]) == 0
    continuous_eval(TINY, overrides)

    with _not_recorded():
        paths = field_paths(load_config(TINY, overrides))
    unread = sorted(path for path, read in paths.items() if read not in reads and path not in ALLOWED)
    assert unread == [], f"config fields no code reads (wire them, reject them, or allowlist with a reason): {unread}"
