"""The store: atomic commits, incomplete folders never read, resumable partials."""

import hashlib
import json
import subprocess
import sys

import pytest

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


def test_commit_takes_the_digest_a_shard_writer_computed_while_writing(tmp_path, monkeypatch):
    # issue 34: the store does not read an output again at commit when its writer hashed it as it wrote it;
    # the manifest's sha256 is the file's, whatever computed it
    from kiln.tasks import store as store_module
    from kiln.tasks.data.documents import Document, write_documents

    store = Store(tmp_path)
    partial = store.begin("dedup", "k1")
    docs = [Document(str(i), f"text {i} " * i, "src", "web", "MIT") for i in range(300)]
    write_documents(partial / "documents" / "00000.jsonl.zst", docs)
    write_documents(partial / "documents" / "00001.jsonl", docs)
    (partial / "stats.json").write_text("{}")  # written without a HashingFile: hashed at commit
    real_sha256, read = store_module.file_sha256, []
    monkeypatch.setattr(store_module, "file_sha256", lambda path: read.append(path.name) or real_sha256(path))
    final = store.commit("dedup", "k1", {"stats": {}})
    assert read == ["stats.json"]
    listed = json.loads((final / MANIFEST_FILE).read_text())["files"]
    assert {rel: real_sha256(final / rel) for rel in listed} == {rel: entry["sha256"] for rel, entry in listed.items()}


def test_a_file_changed_after_its_writer_hashed_it_is_hashed_again(tmp_path):
    from kiln.tasks.data.documents import Document, write_documents
    from kiln.tasks.store import file_sha256, known_sha256

    path = tmp_path / "00000.jsonl"
    write_documents(path, [Document("a", "one", "src", "web", "MIT")])
    data = path.read_bytes()
    path.write_bytes(data.replace(b"one", b"two"))  # same size, new content
    assert known_sha256(path) == file_sha256(path) != hashlib.sha256(data).hexdigest()


def test_digests_noted_in_another_process_are_adopted_while_the_file_is_unchanged(tmp_path, monkeypatch):
    # a rank's worker notes the digests of what it wrote; its ledger record carries them to the driver
    from kiln.tasks import store as store_module

    path = tmp_path / "00000.jsonl.zst"
    script = ("import json, sys; from pathlib import Path; from kiln.tasks.store import take_noted; "
              "from kiln.tasks.data.documents import Document, write_documents; "
              "write_documents(Path(sys.argv[1]), [Document('a', 'text', 'src', 'web', 'MIT')]); "
              "print(json.dumps(take_noted()))")
    noted = json.loads(subprocess.run([sys.executable, "-c", script, str(path)], check=True, capture_output=True,
                                      text=True).stdout)
    expected = store_module.file_sha256(path)
    monkeypatch.setattr(store_module, "file_sha256", lambda path: pytest.fail(f"{path} was read again"))
    store_module.adopt_noted(noted)
    assert store_module.known_sha256(path) == expected
