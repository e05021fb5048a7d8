"""Nothing lost to speed work (issue 34): the bundled sample's data stages, collect to tokenize on the tiny
config, and the dedup stage on a corpus of duplicates, give the accounting, kept documents (byte for
byte), removed records, dedup decisions and index that `tests/fixtures/sample_golden.json` recorded
before the speed work. The one difference allowed is a document that mixed-script decontamination now
removes, listed below (tokenize then sees the documents that remain)."""

from __future__ import annotations

import json

import pytest

from tests.fixtures.sample_golden import DOCUMENT_STAGES, GOLDEN, run_dedup_batches, run_sample, summarise

# Documents of the sample that mixed-script decontamination removes and the golden run kept: none.
MIXED_SCRIPT_REMOVALS: dict[str, str] = {}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("golden")
    return summarise({**run_sample(work / "sample"), **run_dedup_batches(work)})


GOLDEN_SUMMARY = json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("stage", [s for s in DOCUMENT_STAGES if s != "decontaminate"] + ["dedup-1", "dedup-2"])
def test_every_stage_keeps_and_accounts_for_the_same_documents_byte_for_byte(summary, stage):
    got, want = summary[stage], GOLDEN_SUMMARY[stage]
    assert got["accounting"] == want["accounting"]
    assert sorted(set(got["kept"]) ^ set(want["kept"])) == []
    assert [i for i in want["kept"] if got["kept"][i] != want["kept"][i]] == []
    assert got == want  # ...and the whole: kept lines in order, removed records, the dedup index


def test_decontaminate_differs_only_by_the_listed_mixed_script_removals(summary):
    got, want = summary["decontaminate"], GOLDEN_SUMMARY["decontaminate"]
    assert sorted(set(want["kept"]) - set(got["kept"])) == sorted(MIXED_SCRIPT_REMOVALS)
    assert set(got["kept"]) <= set(want["kept"])
    assert {i: h for i, h in want["kept"].items() if i not in MIXED_SCRIPT_REMOVALS} == got["kept"]
    accounting = dict(want["accounting"])
    accounting["num_kept"] -= len(MIXED_SCRIPT_REMOVALS)
    accounting["num_removed"] += len(MIXED_SCRIPT_REMOVALS)
    accounting["removed"] = dict(accounting["removed"])
    for reason in MIXED_SCRIPT_REMOVALS.values():
        accounting["removed"][reason] = accounting["removed"].get(reason, 0) + 1
    assert got["accounting"] == accounting
    if not MIXED_SCRIPT_REMOVALS:
        assert got == want


def test_tokenize_sees_what_decontaminate_kept(summary):
    if MIXED_SCRIPT_REMOVALS:
        assert summary["tokenize"]["num_in"] == summary["decontaminate"]["accounting"]["num_kept"]
    else:
        assert summary["tokenize"] == GOLDEN_SUMMARY["tokenize"]
