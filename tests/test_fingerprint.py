"""Source fingerprints: an unchanged file costs a stat, not a read; a changed file, or a changed object
behind the same s3:// URL (moto's S3 server on loopback), changes the key (a changed local source's
effect on the stage keys: tests/test_graph.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kiln.tasks.data.collect import CollectConfig
from kiln.tasks.data.quality_training import QualityTraining, model_subrun
from kiln.tasks.data.sources import SourceConfig
from kiln.tasks.fingerprint import SETTLE_S, DigestCache, fingerprint_paths


def _settled(paths: list[Path]) -> None:
    """Age files' times past SETTLE_S: their digests may then be cached."""
    past = time.time() - 10 * SETTLE_S
    for path in paths:
        os.utime(path, (past, past))
    while time.time() - max(path.stat().st_ctime for path in paths) < SETTLE_S + 0.1:  # the utime call's own
        time.sleep(0.1)


def test_an_unchanged_file_is_not_read_again_and_a_changed_one_is(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.jsonl").write_text(json.dumps({"text": f"document {i}"}) + "\n")
    _settled(list(corpus.iterdir()))
    cache = DigestCache(tmp_path / "cache.sqlite")
    first = fingerprint_paths([corpus], cache)
    assert cache.num_read == 3
    again = DigestCache(tmp_path / "cache.sqlite")  # another run: only stats
    assert fingerprint_paths([corpus], again) == first and again.num_read == 0

    # Same size, same modification time set back (as rsync -t or tar would): the change time moved.
    changed = corpus / "1.jsonl"
    stat = changed.stat()
    changed.write_text(json.dumps({"text": "document X"}) + "\n")
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert changed.stat().st_size == stat.st_size and changed.stat().st_mtime_ns == stat.st_mtime_ns
    third = DigestCache(tmp_path / "cache.sqlite")
    assert fingerprint_paths([corpus], third) != first and third.num_read == 1
    # It changed just now, so its digest is not kept: a coarse clock could hide another change.
    fourth = DigestCache(tmp_path / "cache.sqlite")
    fingerprint_paths([corpus], fourth)
    assert fourth.num_read == 1


def test_fingerprints_are_content_not_location_of_the_cache(tmp_path):
    (tmp_path / "a.txt").write_text("the same bytes")
    assert fingerprint_paths([tmp_path / "a.txt"], DigestCache(tmp_path / "one.sqlite")) == \
        fingerprint_paths([tmp_path / "a.txt"], DigestCache(tmp_path / "two.sqlite"))
    assert fingerprint_paths([tmp_path / "missing"]) != fingerprint_paths([tmp_path / "a.txt"])
    unusable = DigestCache(tmp_path / "a.txt" / "cache.sqlite")  # a file where its folder should be: read, warn
    assert fingerprint_paths([tmp_path / "a.txt"], unusable) == fingerprint_paths([tmp_path / "a.txt"])


@pytest.fixture(scope="module")
def s3():
    """A bucket on moto's S3 server, listening on loopback."""
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("corpus")
    yield fs, options
    server.stop()


def test_a_changed_object_behind_the_same_url_changes_the_keys(s3):
    fs, options = s3
    fs.pipe("corpus/web/a.jsonl", (json.dumps({"text": "first", "licence": "MIT"}) + "\n").encode())
    fs.pipe("corpus/refs/r.jsonl", (json.dumps({"text": "a reference"}) + "\n").encode())
    source = SourceConfig(name="web", path="s3://corpus/web/", format="jsonl", domain="web", storage_options=options)
    reference = SourceConfig(name="refs", path="s3://corpus/refs/", format="jsonl", domain="reference",
                             storage_options=options)

    def keys() -> tuple[dict, str, str]:
        fs.invalidate_cache()
        training = QualityTraining(references=[reference])
        return CollectConfig(sources=[source]).identity(), training.identity()["remote_references_sha256"]["refs"], \
            model_subrun(training, "collect-key").name

    collect_before, refs_before, model_before = keys()
    assert keys() == (collect_before, refs_before, model_before)  # unchanged objects: the same keys
    fs.pipe("corpus/web/a.jsonl", (json.dumps({"text": "other", "licence": "MIT"}) + "\n").encode())  # same size
    collect_after, refs_after, model_after = keys()
    assert collect_after != collect_before and (refs_after, model_after) == (refs_before, model_before)
    fs.pipe("corpus/refs/r.jsonl", (json.dumps({"text": "b reference"}) + "\n").encode())
    assert keys()[1:] != (refs_before, model_before)  # the quality model trained on it is trained again
