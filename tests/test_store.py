"""The store: atomic commits, incomplete folders never read, resumable partials."""

import json

from kiln.tasks.store import MANIFEST_FILE, Store, stage_key


def test_commit_is_atomic_and_manifest_last(tmp_path):
    store = Store(tmp_path)
    out = store.begin("clean", "abc")
    (out / "documents.jsonl").write_text("{}\n")
    assert not store.is_complete("clean", "abc")
    assert not store.path("clean", "abc").exists()  # nothing visible before commit
    final = store.commit("clean", "abc", {"stats": {"num_in": 1}})
    assert store.is_complete("clean", "abc")
    assert (final / "documents.jsonl").read_text() == "{}\n"
    assert json.loads((final / MANIFEST_FILE).read_text())["stats"] == {"num_in": 1}
    assert not store.partial_path("clean", "abc").exists()


def test_crashed_attempt_is_cleared_unless_resumable(tmp_path):
    store = Store(tmp_path)
    (store.begin("clean", "k") / "half.jsonl").write_text("partial")
    assert not (store.begin("clean", "k") / "half.jsonl").exists()  # a non-resumable stage starts clean
    (store.begin("train", "k", resumable=True) / "checkpoints").mkdir()
    assert (store.begin("train", "k", resumable=True) / "checkpoints").is_dir()  # training keeps its checkpoints


def test_key_depends_on_identity_inputs_and_version():
    base = stage_key("dedup", {"threshold": 0.8}, {"clean": "aaa"}, 1)
    assert base == stage_key("dedup", {"threshold": 0.8}, {"clean": "aaa"}, 1)
    assert base != stage_key("dedup", {"threshold": 0.7}, {"clean": "aaa"}, 1)
    assert base != stage_key("dedup", {"threshold": 0.8}, {"clean": "bbb"}, 1)
    assert base != stage_key("dedup", {"threshold": 0.8}, {"clean": "aaa"}, 2)


def test_abandoned_partials_spare_current_keys_and_running_writers(tmp_path):
    store = Store(tmp_path)
    (store.begin("train", "old", resumable=True) / "checkpoint.pt").write_bytes(b"x" * 1000)
    (store.begin("train", "now", resumable=True) / "checkpoint.pt").write_bytes(b"y")
    store.begin("clean", "running")
    with store.lock("clean", "running"):  # a live writer: never pruned
        abandoned = store.abandoned_partials({"train": "now"})
        assert abandoned == [store.partial_path("train", "old")]
        assert store.prune(abandoned) == 1000
    assert store.partial_folders() == [store.partial_path("clean", "running"), store.partial_path("train", "now")]
    # without current keys, the crashed attempt of `now` is abandoned too (its lock is free now)
    assert store.abandoned_partials() == store.partial_folders()
