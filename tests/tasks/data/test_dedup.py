"""Exact and near-duplicate removal on real text: what is removed, which copy survives, and why;
incremental dedup against a saved index; bad input."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.tasks.data import dedup, minhash
from kiln.tasks.data.dedup import DedupConfig
from kiln.tasks.data.dedup_index import INDEX_ARRAYS, INDEX_DIR, DedupIndex
from kiln.tasks.data.dedup_job import dedup_documents
from kiln.tasks.data.documents import Document, write_documents
from kiln.tasks.data.inspection import accounting
from kiln.tasks.data.shards import KINDS, shard_paths
from kiln.tasks.errors import ConfigError
from tests.fixtures.shards import raw, records, write_stage

# Real prose: the paragraphs of the GNU GPL v3 preamble.
GPL_PREAMBLE = [
    "The GNU General Public License is a free, copyleft license for software and other kinds of works.",
    "The licenses for most software and other practical works are designed to take away your freedom to "
    "share and change the works. By contrast, the GNU General Public License is intended to guarantee "
    "your freedom to share and change all versions of a program--to make sure it remains free software "
    "for all its users. We, the Free Software Foundation, use the GNU General Public License for most of "
    "our software; it applies also to any other work released this way by its authors. You can apply it "
    "to your programs, too.",
    "When we speak of free software, we are referring to freedom, not price. Our General Public Licenses "
    "are designed to make sure that you have the freedom to distribute copies of free software (and "
    "charge for them if you wish), that you receive source code or can get it if you want it, that you "
    "can change the software or use pieces of it in new free programs, and that you know you can do "
    "these things.",
    "To protect your rights, we need to prevent others from denying you these rights or asking you to "
    "surrender the rights. Therefore, you have certain responsibilities if you distribute copies of the "
    "software, or if you modify it: responsibilities to respect the freedom of others.",
    "For example, if you distribute copies of such a program, whether gratis or for a fee, you must pass "
    "on to the recipients the same freedoms that you received. You must make sure that they, too, "
    "receive or can get the source code. And you must show them these terms so they know their rights.",
    "Developers that use the GNU GPL protect your rights with two steps: (1) assert copyright on the "
    "software, and (2) offer you this License giving you legal permission to copy, distribute and/or "
    "modify it.",
    "For the developers' and authors' protection, the GPL clearly explains that there is no warranty for "
    "this free software. For both users' and authors' sake, the GPL requires that modified versions be "
    "marked as changed, so that their problems will not be attributed erroneously to authors of "
    "previous versions.",
    "Some devices are designed to deny users access to install or run modified versions of the software "
    "inside them, although the manufacturer can do so. This is fundamentally incompatible with the aim "
    "of protecting users' freedom to change the software. The systematic pattern of such abuse occurs "
    "in the area of products for individuals to use, which is precisely where it is most unacceptable. "
    "Therefore, we have designed this version of the GPL to prohibit the practice for those products. "
    "If such problems arise substantially in other domains, we stand ready to extend this provision to "
    "those domains in future versions of the GPL, as needed to protect the freedom of users.",
    "Finally, every program is threatened constantly by software patents. States should not allow "
    "patents to restrict development and use of software on general-purpose computers, but in those "
    "that do, we wish to avoid the special danger that patents applied to a free program could make it "
    "effectively proprietary. To prevent this, the GPL assures that patents cannot be used to render "
    "the program non-free.",
]
FULL_PREAMBLE = "\n\n".join(GPL_PREAMBLE)
# Articles 1-5 of the Universal Declaration of Human Rights, in Chinese (no spaces between words).
UDHR_ZH = [
    "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心，并应以兄弟关系的精神相对待。",
    "人人有资格享有本宣言所载的一切权利和自由，不分种族、肤色、性别、语言、宗教、政治或其他见解、国籍或社会出身、"
    "财产、出生或其他身份等任何区别。并且不得因一人所属的国家或领土的政治的、行政的或者国际的地位之不同而有所区别，"
    "无论该领土是独立领土、托管领土、非自治领土或者处于其他任何主权受限制的情况之下。",
    "人人有权享有生命、自由和人身安全。",
    "任何人不得使为奴隶或奴役；一切形式的奴隶制度和奴隶买卖，均应予以禁止。",
    "任何人不得加以酷刑，或施以残忍的、不人道的或侮辱性的待遇或刑罚。",
]


SAMPLE = Path(__file__).resolve().parents[3] / "data" / "sample"


def _doc(doc_id: str, text: str, domain: str = "prose", **metadata) -> Document:
    return Document(doc_id, text, "gpl", domain, "GPL-3.0-or-later", dict(metadata))


def _write(path: Path, docs: list[Document]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_documents(path, docs)
    return path


def _read(out: Path) -> tuple[list[dict], list[dict]]:
    return records(out), records(out, "removed")


def _run(tmp_path: Path, docs: list[Document], name: str = "run", **cfg) -> tuple[dict, list[dict], list[dict]]:
    """Dedup `docs` in `tmp_path/name`; returns the stats, kept and removed records."""
    out = tmp_path / name / "out"
    out.mkdir(parents=True)
    stats = dedup_documents(DedupConfig(**cfg), [_write(tmp_path / name / "in.jsonl", docs)], out)
    kept, removed = _read(out)
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    assert stats["num_kept"] == len(kept) and stats["num_removed"] == len(removed)
    return stats, kept, removed


def _removals(removed: list[dict]) -> list[tuple[str, str, str]]:
    return [(r["id"], r["reason"], r["metadata"]["duplicate_of"]) for r in removed]


def test_exact_copies_differing_in_case_whitespace_and_punctuation_are_removed(tmp_path):
    shouting = GPL_PREAMBLE[2].upper()  # same length as the original
    spaced = GPL_PREAMBLE[1].replace(" ", "  ").replace(". ", ".\n\n")  # longer than the original
    docs = [
        _doc("a", GPL_PREAMBLE[1]),
        _doc("d", shouting),
        _doc("c", spaced),
        _doc("b", GPL_PREAMBLE[2]),
        _doc("e", GPL_PREAMBLE[3]),
        _doc("f", GPL_PREAMBLE[4].replace(",", "").replace(".", "")),
        _doc("g", GPL_PREAMBLE[4]),
    ]
    stats, kept, removed = _run(tmp_path, docs)
    # Survivor: the longest copy ("c" beats "a"), then the smallest id ("b" beats "d", read first).
    assert [d["id"] for d in kept] == ["c", "b", "e", "g"]
    assert _removals(removed) == [
        ("a", "exact_duplicate", "c"),
        ("d", "exact_duplicate", "b"),
        ("f", "exact_duplicate", "g"),
    ]
    assert removed[0]["text"] == GPL_PREAMBLE[1]  # removed records keep the whole document
    assert stats["removed"] == {"exact_duplicate": 3}
    assert stats["num_clusters"] == 3
    assert stats["cluster_sizes"] == {"2": 3}
    assert stats["sample_clusters"][0] == {
        "survivor": "c", "size": 2,
        "members": [{"id": "c", "snippet": spaced[:100]}, {"id": "a", "snippet": GPL_PREAMBLE[1][:100]}],
    }
    assert stats["duplicate_rate_by_domain"] == {"prose": 3 / 7}
    assert stats["lsh"] == {"bands": 14, "rows": 9, "verify_threshold": 0.7}
    assert stats["num_indexed_before"] == 0
    assert (tmp_path / "run" / "out" / "cluster_sizes.png").read_bytes()[:4] == b"\x89PNG"


def test_survivor_is_best_quality_then_longest_then_smallest_id_whatever_the_input_order(tmp_path):
    text = GPL_PREAMBLE[5]
    docs = [
        _doc("z-long", text + " Thank you."),  # longest, but has no quality score
        _doc("m-low", text.upper(), quality_score=0.2),
        _doc("a-high", text.lower(), quality_score=0.9),
        _doc("b9", GPL_PREAMBLE[6]),
        _doc("b10", GPL_PREAMBLE[6].lower()),  # same length, no scores: the smallest id, "b10"
    ]
    stats, kept, removed = _run(tmp_path, docs)
    assert [d["id"] for d in kept] == ["a-high", "b10"]
    assert sorted(_removals(removed)) == [
        ("b9", "exact_duplicate", "b10"),
        ("m-low", "exact_duplicate", "a-high"),
        ("z-long", "near_duplicate", "a-high"),
    ]
    shuffled = _run(tmp_path, docs[::-1], name="reversed")
    assert sorted(d["id"] for d in shuffled[1]) == ["a-high", "b10"]
    assert sorted(_removals(shuffled[2])) == sorted(_removals(removed))


def test_near_duplicate_missing_one_sentence_is_removed_and_longest_survives(tmp_path):
    shortened = FULL_PREAMBLE.replace(
        "The systematic pattern of such abuse occurs in the area of products for individuals to use, "
        "which is precisely where it is most unacceptable. ",
        "",
    )
    assert len(shortened) < len(FULL_PREAMBLE)
    paragraphs = [_doc(f"p{i}", p) for i, p in enumerate(GPL_PREAMBLE)]
    docs = [_doc("short", shortened), *paragraphs, _doc("full", FULL_PREAMBLE)]
    stats, kept, removed = _run(tmp_path, docs)
    # The shortened copy comes first in the input, but the longest text survives.
    assert [d["id"] for d in kept] == [f"p{i}" for i in range(len(GPL_PREAMBLE))] + ["full"]
    assert _removals(removed) == [("short", "near_duplicate", "full")]
    assert stats["num_clusters"] == 1 and stats["cluster_sizes"] == {"2": 1}
    assert stats["num_verified_pairs"] == 1 and stats["num_candidate_pairs"] >= 1

    # Without fuzzy dedup the near duplicate stays: it is not an exact copy.
    stats, kept, _ = _run(tmp_path, docs, name="exact_only", fuzzy=False)
    assert stats["num_kept"] == len(docs) and stats["num_clusters"] == 0


def test_exact_copies_are_caught_by_minhash_when_exact_is_off(tmp_path):
    docs = [_doc("a", GPL_PREAMBLE[7]), _doc("b", GPL_PREAMBLE[7].lower()), _doc("c", GPL_PREAMBLE[8])]
    stats, kept, removed = _run(tmp_path, docs, exact=False)
    assert [d["id"] for d in kept] == ["a", "c"]
    assert _removals(removed) == [("b", "near_duplicate", "a")]


def test_cjk_text_uses_character_shingles_and_is_deduplicated(tmp_path):
    full = "".join(UDHR_ZH)
    without_article_3 = full.replace(UDHR_ZH[2], "")
    docs = [
        _doc("zh-full", full, "multilingual"),
        _doc("zh-cut", without_article_3, "multilingual"),
        _doc("zh-art1", UDHR_ZH[0], "multilingual"),
        _doc("zh-art4", UDHR_ZH[3], "multilingual"),
        _doc("en", GPL_PREAMBLE[1]),
    ]
    stats, kept, removed = _run(tmp_path, docs)
    assert [d["id"] for d in kept] == ["zh-full", "zh-art1", "zh-art4", "en"]
    assert _removals(removed) == [("zh-cut", "near_duplicate", "zh-full")]
    assert stats["duplicate_rate_by_domain"] == {"multilingual": 0.25, "prose": 0.0}


def _japanese_man_page() -> str:
    for line in (SAMPLE / "multilingual" / "multilingual.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["id"].startswith("man-ja/"):
            return record["text"]
    raise AssertionError("the bundled sample has Japanese man pages")


def test_bad_input_is_handled_deterministically(tmp_path):
    rng = np.random.default_rng(7)
    pages = sorted((SAMPLE / "prose" / "coreutils-man").glob("*.txt"))
    vocabulary = sorted({w for p in pages for w in p.read_text().split()})
    words = [vocabulary[i] for i in rng.integers(0, len(vocabulary), size=700_000)]
    enormous = " ".join(words)
    assert len(enormous) > 5_000_000
    edited = list(words)
    edited[350_000], edited[350_001] = words[350_001], words[350_000]  # same length: the smaller id survives
    assert edited != words
    japanese = _japanese_man_page()
    cut = japanese.replace(japanese[200:260], "")
    docs = [
        _doc("empty", ""), _doc("blank", "  \n\t "), _doc("one", "Hello"), _doc("one-copy", "HELLO"),
        _doc("other", "world"), _doc("short", "a b c"), _doc("short-copy", "A B C"),
        _doc("huge", enormous), _doc("huge-edit", " ".join(edited)),
        _doc("ja", japanese, "multilingual"), _doc("ja-cut", cut, "multilingual"),
    ]
    stats, kept, removed = _run(tmp_path, docs)
    assert [d["id"] for d in kept] == ["blank", "one", "other", "short", "huge", "ja"]
    assert sorted(_removals(removed)) == [
        ("empty", "exact_duplicate", "blank"),  # both normalise to "": the longer survives
        ("huge-edit", "near_duplicate", "huge"),
        ("ja-cut", "near_duplicate", "ja"),
        ("one-copy", "exact_duplicate", "one"),
        ("short-copy", "exact_duplicate", "short"),
    ]
    assert stats["cluster_sizes"] == {"2": 5}
    # Without exact dedup, texts without shingles are never matched: empty texts are not alike.
    _, kept, _ = _run(tmp_path, docs[:3], name="fuzzy_only", exact=False)
    assert [d["id"] for d in kept] == ["empty", "blank", "one"]


def test_output_is_identical_with_several_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "_BATCH", 3)  # several batches, so the process pool is used
    docs = [_doc(f"p{i}", p) for i, p in enumerate(GPL_PREAMBLE)] + [
        _doc(f"copy{i}", p.upper()) for i, p in enumerate(GPL_PREAMBLE[:4])
    ] + [_doc("near", FULL_PREAMBLE), _doc("near-cut", FULL_PREAMBLE[:-40])]
    one = _run(tmp_path, docs, name="one")
    two = _run(tmp_path, docs, name="two", num_workers=2)
    assert one == two
    assert one[0]["num_kept"] == len(GPL_PREAMBLE) + 1
    index_one = (tmp_path / "one" / "out" / INDEX_DIR / "index.npz").read_bytes()
    assert index_one == (tmp_path / "two" / "out" / INDEX_DIR / "index.npz").read_bytes()


def test_shards_and_workers_give_the_output_of_one_shard_in_one_process(tmp_path):
    """Signatures per shard in parallel, clusters over all of them: exact and near copies across shards
    are found, and the shards read in order equal one shard's output; so does the saved index."""
    docs = [_doc(f"p{i}", p) for i, p in enumerate(GPL_PREAMBLE)]
    docs += [_doc(f"p{i}-copy", p.upper(), quality_score=0.5) for i, p in enumerate(GPL_PREAMBLE[:4])]
    docs += [_doc("p7-near", GPL_PREAMBLE[7].replace("manufacturer", "vendor")), _doc("zh", UDHR_ZH[1], "multilingual"),
             _doc("zh-copy", UDHR_ZH[1] + "。")]
    runs = {}
    for name, num_shards, workers in (("one", 1, 1), ("five", 5, 2)):
        out = tmp_path / name / "out"
        out.mkdir(parents=True)
        inputs = shard_paths(write_stage(tmp_path / name / "in", docs, num_shards))
        stats = dedup_documents(DedupConfig(num_workers=workers), inputs, out)
        assert stats.pop("executor_cpu_s") == 0
        listing = stats.pop("shards")
        assert sum(shard["num_records"] for shard in listing["documents"]) == stats["num_kept"]
        runs[name] = (stats, [raw(out, kind) for kind in KINDS], (out / INDEX_DIR / "index.npz").read_bytes())
    assert runs["one"] == runs["five"]
    stats = runs["one"][0]
    assert stats["removed"] == {"exact_duplicate": 5, "near_duplicate": 1}
    # copies with a score beat the originals, the longer copy of the Chinese text wins; kept in input order
    assert [d["id"] for d in records(tmp_path / "five" / "out")] == [
        "p4", "p5", "p6", "p7", "p8", "p0-copy", "p1-copy", "p2-copy", "p3-copy", "zh-copy"]


def test_worker_count_is_not_part_of_the_identity():
    assert DedupConfig(num_workers=4).identity() == DedupConfig().identity()
    with pytest.raises(ValueError):
        DedupConfig(threshold=1.5)


def test_a_new_batch_is_deduplicated_against_the_saved_index_without_resigning_it(tmp_path, monkeypatch):
    batch_a = [_doc(f"a{i}", p) for i, p in enumerate(GPL_PREAMBLE)] + [_doc("a9-copy", GPL_PREAMBLE[0].upper())]
    out_a = tmp_path / "a"
    out_a.mkdir()
    stats_a = dedup_documents(DedupConfig(), [_write(tmp_path / "a.jsonl", batch_a)], out_a)
    assert stats_a["num_kept"] == len(GPL_PREAMBLE)

    changed_word = GPL_PREAMBLE[7].replace("manufacturer", "vendor")
    batch_b = [
        _doc("b-new", UDHR_ZH[1], "multilingual"),
        _doc("b-exact", GPL_PREAMBLE[3].lower()),  # exact copy of a3
        _doc("b-near", changed_word),  # near copy of a7
        _doc("b-pair1", FULL_PREAMBLE),  # new, and duplicated by b-pair2 within the batch
        _doc("b-pair2", FULL_PREAMBLE.replace("Finally, ", "")),
        _doc("b-long", GPL_PREAMBLE[2] + " And more, much more."),  # longer than a2, but a2 is published
    ]
    signed: list[int] = []
    real_signatures = minhash.signatures_utf8
    monkeypatch.setattr(minhash, "signatures_utf8", lambda texts, *a, **k: signed.append(len(texts)) or real_signatures(texts, *a, **k))
    out_b = tmp_path / "b"
    out_b.mkdir()
    stats = dedup_documents(DedupConfig(), [_write(tmp_path / "b.jsonl", batch_b)], out_b, index_dir=out_a / INDEX_DIR)
    assert signed == [len(batch_b)]  # only the new batch is signed; a's signatures are loaded
    kept, removed = _read(out_b)
    assert [d["id"] for d in kept] == ["b-new", "b-pair1"]
    assert _removals(removed) == [
        ("b-exact", "exact_duplicate", "a3"),
        ("b-near", "near_duplicate", "a7"),
        ("b-pair2", "near_duplicate", "b-pair1"),
        ("b-long", "near_duplicate", "a2"),
    ]
    assert stats["num_indexed_before"] == len(GPL_PREAMBLE)
    assert stats["duplicate_rate_by_domain"] == {"multilingual": 0.0, "prose": 0.8}

    combined = DedupIndex.load(out_b / INDEX_DIR, DedupIndex.load(out_a / INDEX_DIR, _settings()).settings)
    assert combined.ids.tolist() == [d.id for d in batch_a[:-1]] + ["b-new", "b-pair1"]
    a_index = DedupIndex.load(out_a / INDEX_DIR, _settings())
    assert np.array_equal(combined.signatures[: len(a_index)], a_index.signatures)
    with pytest.raises(ConfigError, match="num_perm"):
        dedup_documents(DedupConfig(num_perm=64), [tmp_path / "b.jsonl"], tmp_path, index_dir=out_a / INDEX_DIR)


def _settings() -> dict:
    return dedup.signature_settings(DedupConfig())


def test_removal_report_counts_documents_and_bytes_by_domain_and_reason(tmp_path):
    docs = [
        _doc("a", GPL_PREAMBLE[1]),
        _doc("a-copy", GPL_PREAMBLE[1].upper()),
        _doc("b", GPL_PREAMBLE[2], domain="web"),
        _doc("b-near", GPL_PREAMBLE[2].replace(" (and charge for them if you wish)", ""), domain="web"),
        _doc("c", GPL_PREAMBLE[3], domain="web"),
        _doc("zh", UDHR_ZH[1], domain="multilingual"),
    ]
    stats, _, _ = _run(tmp_path, docs)
    out = tmp_path / "run" / "out"
    size = {d.id: len(d.text.encode()) for d in docs}
    assert stats["accounting"] == {
        "multilingual": {"in": {"docs": 1, "bytes": size["zh"]}, "kept": {"docs": 1, "bytes": size["zh"]},
                         "removed": {}, "quarantined": {}},
        "prose": {"in": {"docs": 2, "bytes": size["a"] * 2}, "kept": {"docs": 1, "bytes": size["a"]},
                  "removed": {"exact_duplicate": {"docs": 1, "bytes": size["a-copy"]}}, "quarantined": {}},
        "web": {"in": {"docs": 3, "bytes": size["b"] + size["b-near"] + size["c"]},
                "kept": {"docs": 2, "bytes": size["b"] + size["c"]},
                "removed": {"near_duplicate": {"docs": 1, "bytes": size["b-near"]}}, "quarantined": {}},
    }
    # The stage's own tally is what the shared inspection code reads back from its files.
    assert stats["accounting"] == accounting(out) == json.loads((out / "removals.json").read_text())
    assert "| web | removed | near_duplicate | 1 |" in (out / "removals.md").read_text()
    assert (out / "removals.png").read_bytes()[:4] == b"\x89PNG"


def test_an_exact_copy_that_survives_keeps_its_own_signature_in_the_index(tmp_path):
    # The copy is read second (so it is not signed again) but wins on quality: the index must hold
    # the signature of its text, which equals the first copy's.
    docs = [_doc("first", GPL_PREAMBLE[6]), _doc("second", GPL_PREAMBLE[6].upper(), quality_score=0.9),
            _doc("other", GPL_PREAMBLE[7])]
    _, kept, _ = _run(tmp_path, docs)
    assert [d["id"] for d in kept] == ["second", "other"]
    cfg = DedupConfig()
    index = DedupIndex.load(tmp_path / "run" / "out" / INDEX_DIR, dedup.signature_settings(cfg))
    expected = minhash.signatures([dedup.normalize(d.text, cfg) for d in docs[1:]], cfg.shingle_size, cfg.num_perm,
                                  cfg.seed)
    assert index.ids.tolist() == ["second", "other"]
    assert np.array_equal(index.signatures, expected)


def test_documents_are_written_as_to_json_and_removal_records_as_reason_log_whatever_the_input_form(tmp_path):
    # Canonical lines are copied or spliced, others re-serialised: both must give these exact bytes.
    quoted = 'Ünïcode "quoted" \\ back\tslash\u2028 ' + GPL_PREAMBLE[3]
    docs = [
        _doc("a", GPL_PREAMBLE[1]),  # no metadata: removed, duplicate_of opens its metadata
        _doc("a-copy", GPL_PREAMBLE[1].upper(), quality_score=0.5),
        _doc("b", GPL_PREAMBLE[2], quality_score=0.9),
        _doc("b-copy", GPL_PREAMBLE[2] + " ", duplicate_of="earlier"),  # replaced in place, not appended
        _doc("c", quoted, lang="fr", tags=["x"]),
        _doc("c-copy", quoted.lower(), lang="fr"),
        _doc("d", FULL_PREAMBLE),
        _doc("d-cut", FULL_PREAMBLE[:-40], lang="en"),
    ]
    canonical = _write(tmp_path / "canonical.jsonl", docs)
    other_forms = [
        lambda r: json.dumps(r),  # ASCII escapes
        lambda r: json.dumps(dict(reversed(r.items())), ensure_ascii=False),
        lambda r: json.dumps({**r, "extra": 1}, ensure_ascii=False),  # dropped, as from_dict drops it
        lambda r: json.dumps({k: v for k, v in r.items() if not (k == "metadata" and not v)}, ensure_ascii=False),
        lambda r: json.dumps(r, ensure_ascii=False, separators=(",", ":")),
        lambda r: json.dumps(r, ensure_ascii=False) + "\r",
    ]
    lines = [other_forms[i % len(other_forms)](vars(d)) for i, d in enumerate(docs)]
    lines.insert(3, "  ")
    odd = tmp_path / "odd.jsonl"
    odd.write_bytes(("\n".join(lines)).encode("utf-8"))  # no newline after the last line
    outputs = []
    for name, input_file in (("canonical", canonical), ("odd", odd)):
        out = tmp_path / name
        out.mkdir()
        stats = dedup_documents(DedupConfig(), [input_file], out)
        outputs.append([raw(out), raw(out, "removed"), (out / "removals.json").read_bytes()])
        assert (stats["num_kept"], stats["removed"]) == (4, {"exact_duplicate": 3, "near_duplicate": 1})
    assert outputs[0] == outputs[1]
    by_id = {d.id: d for d in docs}
    assert outputs[0][0].decode("utf-8") == "".join(by_id[i].to_json() + "\n" for i in ("a-copy", "b", "c", "d"))
    removals = [("a", "exact_duplicate", "a-copy"), ("b-copy", "exact_duplicate", "b"),
                ("c-copy", "exact_duplicate", "c"), ("d-cut", "near_duplicate", "d")]
    expected = []
    for doc_id, reason, survivor in removals:
        record = vars(by_id[doc_id]) | {"metadata": by_id[doc_id].metadata | {"duplicate_of": survivor}}
        expected.append(json.dumps({"reason": reason, **record}, ensure_ascii=False) + "\n")
    assert outputs[0][1].decode("utf-8") == "".join(expected)
    assert '"metadata": {"duplicate_of": "b", "quality_score"' not in expected[1]  # its key kept its place
    assert expected[1].endswith('"metadata": {"duplicate_of": "b"}}\n')


@pytest.mark.parametrize("punctuation", [True, False])
@pytest.mark.parametrize("whitespace", [True, False])
def test_normalize_deletes_every_punctuation_code_point_and_collapses_every_whitespace(punctuation, whitespace):
    every_space = "".join(chr(c) for c in range(0x3001) if chr(c).isspace())  # U+3000 is Unicode's last
    texts = ["", " ", "!!", " ! ", "\x1c a \x1d", "a\x85b\u2028c", "¡Hola!  ¿Qué\u00a0tal?", "\ud800 x",
             "\U00010100 x", f"{every_space}a{every_space}b,{every_space}", "Ｆｕｌｌ－ｗｉｄｔｈ", UDHR_ZH[0]]
    cfg = DedupConfig(normalize_punctuation=punctuation, normalize_whitespace=whitespace)
    for text in texts:
        expected = unicodedata.normalize("NFKC", text).casefold()
        if punctuation:
            expected = "".join(c for c in expected if not unicodedata.category(c).startswith("P"))
        if whitespace:
            expected = " ".join(expected.split())
        assert dedup.normalize(text, cfg) == expected, text
    assert dedup.normalize("¡Hola!  ¿Qué\u00a0tal?", DedupConfig()) == "hola qué tal"


# Characters the batch normalisation treats apart: whitespace, punctuation, folds in place (É, Σ, Д, Ｆ)
# and not (ß, ẞ, İ, ǅ, the Kelvin sign), lone surrogates, astral letters that fold (Deseret), CJK, NUL.
_TRICKY = (" \t\n\x1c\x85\xa0\u2028\u3000!?.,;:-—«»“”¡¿。、（）ＦｕＡaZéÉßẞİΣσςǅ\u212aДд中文ひ"
           "\ud800\udfff\x00\x7f\xff\U00010400\U00010428\U0001f600\u0301")


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(st.text(st.one_of(st.sampled_from(_TRICKY), st.characters(blacklist_categories=())), max_size=40),
                max_size=12),
       st.booleans(), st.booleans(), st.booleans())
def test_a_batch_normalises_to_the_utf8_of_normalize_text_by_text(texts, case, punctuation, whitespace):
    # issue 34: the stage normalises a signature batch at once, in UTF-8 bytes (`_normalized_utf8`)
    cfg = DedupConfig(normalize_case=case, normalize_punctuation=punctuation, normalize_whitespace=whitespace)
    assert dedup._normalized_utf8(texts, cfg) == [dedup.normalize(t, cfg).encode("utf-8", "surrogatepass")
                                                  for t in texts]


def test_a_batch_folds_every_character_casefold_changes_as_casefold_does():
    # every code point casefold changes, in one batch: folds written over the bytes in place, and the others
    folding = [chr(c) for c in range(0x110000) if chr(c).casefold() != chr(c)]
    assert len(folding) > 1400
    for cfg in (DedupConfig(), DedupConfig(normalize_punctuation=False, normalize_whitespace=False)):
        # one text a character (most fold in place; a text holding one that does not goes through str.casefold)
        texts = [f"{c}, {c}x{c}" for c in folding] + [" ".join(folding)]
        assert dedup._normalized_utf8(texts, cfg) == [dedup.normalize(t, cfg).encode("utf-8") for t in texts]



def test_shards_and_index_are_committed_without_being_read_again(tmp_path, monkeypatch):
    # issue 34: each rank hashes its shards as it writes them, in its own worker process; its ledger record
    # carries the digests to this process, whose commit lists them without reading the shards again
    from kiln.tasks import store as store_module

    copies = [_doc(f"d{i}", GPL_PREAMBLE[i % 4]) for i in range(20)]
    distinct = [_doc(f"u{i}", " ".join(f"word{i * j}" for j in range(40))) for i in range(20)]
    docs = [doc for pair in zip(copies, distinct) for doc in pair]  # both shards keep and remove some
    inputs = shard_paths(write_stage(tmp_path / "in", docs, 2))
    store = store_module.Store(tmp_path / "store")
    out = store.begin("dedup", "k")
    stats = dedup_documents(DedupConfig(num_workers=2), inputs, out)
    assert (stats["num_kept"], stats["num_removed"]) == (24, 16)
    real_sha256, read = store_module.file_sha256, []
    monkeypatch.setattr(store_module, "file_sha256", lambda path: read.append(path) or real_sha256(path))
    final = store.commit("dedup", "k", {"stats": {}})
    shards = [p.relative_to(final).as_posix() for kind in KINDS for p in sorted((final / kind).glob("*"))]
    assert len(shards) == 4  # kept and removed, two shards each
    index = f"{INDEX_DIR}/{INDEX_ARRAYS}"  # streamed into a hashed file too, by the stage's own process
    assert (final / index).is_file()
    assert not {p.relative_to(out).as_posix() for p in read} & {*shards, index}
    monkeypatch.undo()
    assert store.problems("dedup", "k", checksums=True) == []  # the digests listed are the files' own
