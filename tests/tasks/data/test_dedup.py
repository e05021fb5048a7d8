"""Exact and near-duplicate removal on real text: what is removed, which copy survives, and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.data import dedup
from tasks.data.dedup import DedupConfig, dedup_documents, shingles
from tasks.data.documents import Document, write_documents

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


def _doc(doc_id: str, text: str, domain: str = "prose") -> Document:
    return Document(doc_id, text, "gpl", domain, "GPL-3.0-or-later")


def _run(tmp_path: Path, docs: list[Document], name: str = "run", **cfg) -> tuple[dict, list[dict], list[dict]]:
    """Dedup `docs` in `tmp_path/name`; returns the stats, kept and removed records."""
    work = tmp_path / name
    out = work / "out"
    out.mkdir(parents=True)
    input_file = work / "in.jsonl"
    write_documents(input_file, docs)
    stats = dedup_documents(DedupConfig(**cfg), input_file, out)
    kept = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    removed_file = out / "removed.jsonl"
    removed = [json.loads(line) for line in removed_file.read_text().splitlines()] if removed_file.exists() else []
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"]
    assert stats["num_kept"] == len(kept) and stats["num_removed"] == len(removed)
    return stats, kept, removed


def test_exact_copies_differing_in_case_whitespace_and_punctuation_are_removed(tmp_path):
    shouting = GPL_PREAMBLE[2].upper()  # same length as the original
    spaced = GPL_PREAMBLE[1].replace(" ", "  ").replace(". ", ".\n\n")  # longer than the original
    docs = [
        _doc("a", GPL_PREAMBLE[1]),
        _doc("b", GPL_PREAMBLE[2]),
        _doc("c", spaced),
        _doc("d", shouting),
        _doc("e", GPL_PREAMBLE[3]),
        _doc("f", GPL_PREAMBLE[4].replace(",", "").replace(".", "")),
        _doc("g", GPL_PREAMBLE[4]),
    ]
    stats, kept, removed = _run(tmp_path, docs)
    # Survivor: the longest copy ("c" beats the earlier "a"), then the earliest ("b" beats "d").
    assert [d["id"] for d in kept] == ["b", "c", "e", "g"]
    assert [(r["id"], r["reason"], r["metadata"]["duplicate_of"]) for r in removed] == [
        ("a", "exact_duplicate", "c"),
        ("d", "exact_duplicate", "b"),
        ("f", "exact_duplicate", "g"),
    ]
    assert removed[0]["text"] == GPL_PREAMBLE[1]  # removed records keep the whole document
    assert stats["removed"] == {"exact_duplicate": 3}
    assert stats["num_clusters"] == 3
    assert stats["cluster_sizes"] == {"2": 3}
    assert stats["sample_clusters"][0] == {"survivor": "c", "members": ["a", "c"], "size": 2}
    assert stats["duplicate_rate_by_domain"] == {"prose": 3 / 7}


def test_exact_only_keeps_case_variants_when_case_normalisation_is_off(tmp_path):
    docs = [_doc("a", GPL_PREAMBLE[2]), _doc("b", GPL_PREAMBLE[2].upper()), _doc("c", GPL_PREAMBLE[2])]
    stats, kept, removed = _run(tmp_path, docs, fuzzy=False, normalize_case=False)
    assert [d["id"] for d in kept] == ["a", "b"]
    assert [(r["id"], r["reason"]) for r in removed] == [("c", "exact_duplicate")]


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
    assert [(r["id"], r["reason"], r["metadata"]["duplicate_of"]) for r in removed] == [
        ("short", "near_duplicate", "full")
    ]
    assert stats["num_clusters"] == 1 and stats["cluster_sizes"] == {"2": 1}

    # Without fuzzy dedup the near duplicate stays: it is not an exact copy.
    stats, kept, _ = _run(tmp_path, docs, name="exact_only", fuzzy=False)
    assert stats["num_kept"] == len(docs) and stats["num_clusters"] == 0


def test_exact_copies_are_caught_by_minhash_when_exact_is_off(tmp_path):
    docs = [_doc("a", GPL_PREAMBLE[7]), _doc("b", GPL_PREAMBLE[7].lower()), _doc("c", GPL_PREAMBLE[8])]
    stats, kept, removed = _run(tmp_path, docs, exact=False)
    assert [d["id"] for d in kept] == ["a", "c"]
    assert [(r["id"], r["reason"], r["metadata"]["duplicate_of"]) for r in removed] == [
        ("b", "near_duplicate", "a")
    ]


def test_cjk_text_uses_character_shingles_and_is_deduplicated(tmp_path):
    full = "".join(UDHR_ZH)
    assert sorted(shingles("人人有权享有生命", 5)) == sorted(
        g.encode() for g in ["人人有权享", "人有权享有", "有权享有生", "权享有生命"]
    )
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
    assert [(r["id"], r["reason"], r["metadata"]["duplicate_of"]) for r in removed] == [
        ("zh-cut", "near_duplicate", "zh-full")
    ]
    assert stats["duplicate_rate_by_domain"] == {"multilingual": 0.25, "prose": 0.0}


def test_word_shingles_for_spaced_text_and_characters_for_short_text():
    assert sorted(shingles("one two three", 2)) == [b"one two", b"two three"]
    assert shingles("hi", 5) == [b"hi"]  # shorter than one shingle: the whole text
    assert shingles("", 5) == []


def test_output_is_identical_with_several_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup, "_BATCH", 3)  # several batches, so the process pool is used
    docs = [_doc(f"p{i}", p) for i, p in enumerate(GPL_PREAMBLE)] + [
        _doc(f"copy{i}", p.upper()) for i, p in enumerate(GPL_PREAMBLE[:4])
    ]
    one = _run(tmp_path, docs, name="one")
    two = _run(tmp_path, docs, name="two", num_workers=2)
    assert one == two
    assert one[0]["num_kept"] == len(GPL_PREAMBLE)


def test_worker_count_is_not_part_of_the_identity():
    assert DedupConfig(num_workers=4).identity() == DedupConfig().identity()
    with pytest.raises(ValueError):
        DedupConfig(threshold=1.5)
