"""A collect stage killed mid-write and rerun gives the same bytes as a clean run: nothing lost, nothing twice.

The stage runs in a subprocess through the plain-Python runner (`run_stage`, no-op tracker) and is
sent SIGKILL once it has written two shards and begun a third; the rerun (here, in-process) resumes
the partial folder (the tasks the run ledger holds finished are skipped, the others' files removed), and
its committed files must hash as a clean run's do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.data.documents import read_documents, read_shards
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.graph import stage_keys
from kiln.tasks.runner import run_stage
from kiln.tasks.stage import Registry
from kiln.tasks.stages import collect as collect_stage
from kiln.tasks.store import Store
from tests.fixtures import toy_stage

REPO = Path(__file__).resolve().parents[3]
TOY = str(REPO / "tests/fixtures/toy.yaml")
LICENCES = ["PSF-2.0", "GPL-2+", "Vim", "BSD-4-Clause-UC (fortune-mod; collected quotations)", "Frobnicate"]

_CHILD = """
import sys
from kiln.tasks.config import load_config
from kiln.tasks.runner import run_stage
from kiln.tasks.stage import Registry
from kiln.tasks.stages import collect
from tests.fixtures import toy_stage
registry = Registry([collect.STAGE, toy_stage.STAGE])
run_stage("collect", load_config(sys.argv[1], sys.argv[2:], registry=registry), registry=registry)
"""


def _big_source(path: Path, num_records: int) -> None:
    """Real records of the sample corpus, renumbered, with every kind of outcome mixed in."""
    real = [json.loads(line) for line in (REPO / "data/sample/code/code.jsonl").read_text().splitlines()]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(num_records):
            if i % 101 == 7:
                out.write('{"text": "cut off\n')
                continue
            record = real[i % len(real)]
            out.write(json.dumps({"id": i, "text": f"{record['text'][:1000]}\n# {i}", "licence": LICENCES[i % 5],
                                  "metadata": record["metadata"]}) + "\n")


def _output_hashes(store: Store, key: str) -> dict[str, str]:
    files = store.manifest("collect", key)["files"]
    return {name: info["sha256"] for name, info in files.items() if name != "stats.json"}


@pytest.mark.timeout(300)
def test_a_killed_collect_reruns_to_the_same_bytes(tmp_path):
    source = tmp_path / "big.jsonl"
    _big_source(source, 15_000)
    registry = Registry([collect_stage.STAGE, toy_stage.STAGE])
    sources = f"collect.sources=[{{name: big, path: {source}, format: jsonl, domain: code, licence: MIT}}]"
    overrides = [sources, "collect.max_docs_per_source=null", "collect.shard_bytes=500000"]
    killed_cfg = load_config(TOY, [*overrides, f"work_dir={tmp_path / 'killed'}"], registry=registry)
    clean_cfg = load_config(TOY, [*overrides, f"work_dir={tmp_path / 'clean'}"], registry=registry)
    key = stage_keys(killed_cfg, registry)["collect"]
    assert stage_keys(clean_cfg, registry)["collect"] == key  # work_dir is no part of the key
    store = Store(killed_cfg.store_root)
    partial_documents = store.partial_path("collect", key) / "documents"

    child = subprocess.Popen([sys.executable, "-c", _CHILD, TOY, *overrides, f"work_dir={tmp_path / 'killed'}"],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list(partial_documents.glob("*.jsonl.zst"))) < 3:  # two shards written, a third begun
            assert child.poll() is None, f"the stage ended before it could be killed: {child.stderr.read().decode()}"
            assert time.monotonic() < deadline, "the stage never started writing"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()  # reaped, so the key lock's owner is seen as dead
    assert child.returncode == -signal.SIGKILL
    assert not store.is_complete("collect", key) and store.partial_path("collect", key).is_dir()
    written_before_kill = sum(len(list(read_documents(shard))) for shard in sorted(partial_documents.glob("*"))[:-1])

    rerun = run_stage("collect", killed_cfg, registry=registry)
    clean = run_stage("collect", clean_cfg, registry=registry)
    assert (rerun.status, clean.status) == ("ran", "ran")
    assert _output_hashes(store, key) == _output_hashes(Store(clean_cfg.store_root), key)
    assert store.partial_folders() == []

    stats = store.manifest("collect", key)["stats"]
    assert stats["num_in"] == 15_000 and stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    ids = [doc.id for doc in read_shards(shard_paths(Path(rerun.path)))]
    assert len(ids) == len(set(ids)) == stats["num_kept"] > written_before_kill
    assert len(stats["shards"]["documents"]) > 3
