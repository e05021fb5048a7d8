"""The whole pipeline on a corpus of one's own (`configs/examples/own-data.yaml`, built by
`scripts/build_own_data.py`): five domains none of which the default config knows, a domain field per
record, licences as PyPI and Debian write them, extra fields, and jsonl, .jsonl.gz, parquet, WARC and a
jsonl file in an S3 bucket (moto's server). It runs as a user would run it: from a project folder of their
own, with the bucket's endpoint and credentials in the environment, no workaround."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fsspec.config
import pytest

from kiln.flows.cli import main
from kiln.tasks.config import load_config
from kiln.tasks.data.licences import normalise
from kiln.tasks.graph import stage_keys
from kiln.tasks.stages import REGISTRY
from kiln.tasks.store import Store
from tests.fixtures.shards import records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the whole pipeline: 200 s measured at load average 12
REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/examples/own-data.yaml"
sys.path.insert(0, str(REPO / "scripts"))

import build_own_data  # noqa: E402


@pytest.fixture
def bucket(monkeypatch):
    """moto's S3 server on loopback, reached as a user's environment would reach a bucket."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    # what FSSPEC_S3_ENDPOINT_URL sets when fsspec is imported (here it was imported already)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://{host}:{port}"})
    yield "s3://kiln-own-data"
    server.stop()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's folder: Kiln's configs and bundled data beside their own corpus."""
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_licence_spellings_of_the_example_name_the_records_real_licences():
    for real, spellings in build_own_data.WRITTEN.items():
        for written in spellings:
            assert normalise(written) == real or real == "Vim", written  # "Vim License": no table maps it


def test_the_whole_pipeline_on_a_corpus_of_ones_own(prefect_api, project, bucket, capfd):
    counts = build_own_data.build(project / "own-data", bucket)
    assert counts["notes/posts.jsonl"] == 12 and not (project / "own-data/notes").exists()

    assert main(["run", CONFIG, f"work_dir={project / 'work'}"]) == 0
    err = capfd.readouterr().err
    cfg = load_config(CONFIG, [f"work_dir={project / 'work'}"])
    store, keys = Store(cfg.store_root), stage_keys(cfg)
    assert all(store.is_complete(name, keys[name]) for name in REGISTRY.pipeline())

    collect = store.path("collect", keys["collect"])
    stats = json.loads((collect / "_kiln_manifest.json").read_text())["stats"]
    assert set(stats["by_domain"]) == {"manuals", "translations", "source", "guides", "notes"}
    assert stats["by_format"] == {"jsonl": 42, "parquet": 10, "warc": 10}
    assert stats["by_source"]["crawl"] == 10  # the pages served as text/html, fragments included
    assert stats["by_source"]["notes"] == 12  # plain jsonl in the bucket
    assert stats["quarantined"] == {"unknown_domain": 1}  # the record saying `blog`
    assert stats["removed"] == {"licence_unknown:Vim License": 1}  # reported, not guessed
    docs = records(collect)
    by_id = {doc["id"]: doc for doc in docs}
    german = by_id["articles/man-de/man8/chgpasswd.8"]
    assert (german["domain"], german["licence"], german["metadata"]["lang"]) == ("translations", "BSD-3-Clause", "de")
    assert german["metadata"]["licence_as_written"] == "BSD License"
    assert by_id["articles/util-linux/addpart.8"]["domain"] == "manuals"  # no domain field: the source's
    assert by_id["archive/kiln/tasks/errors.py"]["licence"] == "Apache-2.0"
    notes = [doc for doc in docs if doc["source"] == "notes"]
    assert {doc["domain"] for doc in notes} == {"notes"} and all("version" in doc["metadata"] for doc in notes)
    compliance = (collect / "compliance.md").read_text()
    assert "| archive | Python Software Foundation License | PSF-2.0 | allowed |" in compliance

    tokenize = json.loads((store.path("tokenize", keys["tokenize"]) / "_kiln_manifest.json").read_text())["stats"]
    assert set(tokenize["tokens_by_domain"]) == {"manuals", "translations", "source", "guides", "notes"}
    assert (store.path("evaluate", keys["evaluate"]) / "report.md").is_file()
    # the terminal: progress lines, no library noise
    assert "clean: 62/62 documents (100%)" in err and "sweep (IsoFLOP and mixture trials): 8/8 trials" in err
    assert "Generating test split" not in err and "Traceback" not in err
    assert "Generating test split" in (store.path("evaluate", keys["evaluate"]) / "anneal" / "libraries.log").read_text()
