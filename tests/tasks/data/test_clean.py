"""Tests for the clean stage: real fastText lid.176 and real datatrove filters on real text.

The texts are real: the DESCRIPTION of apt-transport-https(1) from the English, German and
French manual pages, the first paragraph of the Japanese chage(1) page, and `textwrap.indent`
from CPython's standard library.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.tasks.data.clean import STATS_FILE, CleanConfig, clean_documents
from kiln.tasks.data.documents import Document, read_shards
from kiln.tasks.data.inspection import accounting
from kiln.tasks.data.shards import KINDS, LISTING_FILE, shard_paths
from kiln.tasks.errors import ConfigError, InputError
from tests.fixtures.shards import raw, records, write_stage

EN = (
    "This APT transport allows the use of repositories accessed via the HTTP Secure protocol (HTTPS), also "
    "referred to as HTTP over TLS. It is available by default since apt 1.5 and was available before that in the "
    "package apt-transport-https. Note that a transport is never called directly by a user but used by APT tools "
    "based on user configuration.\n\n"
    "HTTP is by itself an unencrypted transport protocol (compare apt-transport-http(1)), which, as indicated by "
    "the appended S, is wrapped in an encrypted layer known as Transport Layer Security (TLS) to provide end-to-end "
    "encryption. A sufficiently capable attacker can still observe the communication partners and deeper analysis "
    "of the encrypted communication might still reveal important details. An overview over available alternative "
    "transport methods is given in sources.list(5)."
)
DE = (
    "Diese APT-Transportmethode ermöglicht die Verwendung von Depots, auf die mittels des "
    "HTTP-Sicherheitsprotokolls (HTTPS), auch unter HTTP über TLS bekannt, zugegriffen werden kann. Es ist "
    "standardmäßig seit APT 1.5 verfügbar und war zuvor im Paket apttransport-https verfügbar. Beachten Sie, dass "
    "eine Transportmethode niemals direkt durch einen Benutzer aufgerufen wird, jedoch von APT-Werkzeugen basierend "
    "auf der Konfiguration des Benutzers.\n\n"
    "HTTP selbst ist ein unverschlüsseltes Transportprotokoll (vergleichen Sie apt-transport-http(1)), das, wie es "
    "das angehängte S angibt, in eine verschlüsselte Ebene, bekannt als Transport Layer Security (TLS), eingepackt "
    "wird, um eine Ende-zu-Ende-Verschlüsselung bereitzustellen. Ein Angreifer mit ausreichenden Fähigkeiten kann "
    "die Kommunikationspartner immer noch beobachten und eine tiefere Analyse der verschlüsselten Kommunikation "
    "könnte immer noch wichtige Einzelheiten offenbaren. Einen Überblick über alternative Transportmethoden finden "
    "Sie in der sources.list(5)."
)
FR = (
    "Ce transport d'APT permet d'utiliser les dépôts auxquels on accède au moyen de HTTPS (protocole HTTP Secure), "
    "aussi appelé HTTP sur TLS. Il est disponible par défaut depuis apt 1.5 et était disponible auparavant dans "
    "lepaquet apt-transport-https. Veuillez noter qu'un transport n'est jamais appelé directement par "
    "l'utilisateur, maisutilisé par les outils d'APT s'appuyant sur la configuration de l'utilisateur.\n\n"
    "HTTP est un protocole de transport non chiffré (comparez avec apt-transport-http(1)), qui, comme l'indique le "
    "S ajouté, est enveloppé dans une couche chiffrée, connue sous le nom de « Transport Layer Security » (TLS), "
    "pour fournir un chiffrement de bout en bout. Un attaquant suffisamment compétent peut encore observer les "
    "partenaires de la communication et une analyse approfondie de la communication chiffrée pourrait toujours "
    "révéler des détails importants. Un aperçu des méthodes de transport alternatives disponibles est donné dans "
    "sources.list(5)."
)
JA = (
    "chage は、 パスワードを最後に更新してから、 次に変更しなければならない期日までの日数を変更する。 "
    "システムはこの情報を用いて、 ユーザがいつパスワードを変更しなければならないかを決定する。 "
    "chage コマンドを使えるのは root ユーザのみに限られている。 ただし一般ユーザも -l オプションを指定すれば"
    "このコマンドを利用でき、 自分のパスワードまたはアカウントがいつ切れるかを知ることができる。"
)
CODE = '''def indent(text, prefix, predicate=None):
    """Adds 'prefix' to the beginning of selected lines in 'text'.

    If 'predicate' is provided, 'prefix' will only be added to the lines
    where 'predicate(line)' is True. If 'predicate' is not provided,
    it will default to adding 'prefix' to all non-empty lines that do not
    consist solely of whitespace characters.
    """
    if predicate is None:
        def predicate(line):
            return line.strip()

    def prefixed_lines():
        for line in text.splitlines(True):
            yield (prefix + line if predicate(line) else line)
    return ''.join(prefixed_lines())
'''
EN_FIRST_PARAGRAPH = EN.split("\n\n")[0]
# 37 words: under Gopher's 50-word minimum, but long enough that no single 3-gram dominates it.
EN_TWO_SENTENCES = EN_FIRST_PARAGRAPH.split(" Note that")[0]


def _doc(doc_id: str, text: str, domain: str) -> Document:
    return Document(doc_id, text, source="man-pages", domain=domain, licence="GPL-2.0", metadata={"page": doc_id})


CORPUS = [
    _doc("en", EN, "web"),
    _doc("ja", JA, "prose"),
    _doc("de", DE, "multilingual"),
    _doc("code", CODE, "code"),
    _doc("repetitive", "\n\n".join([EN_FIRST_PARAGRAPH] * 4), "web"),
    _doc("blank", " \n\t", "web"),
    _doc("short", EN_TWO_SENTENCES, "prose"),
    _doc("fr", FR, "multilingual"),
]


def _run(tmp_path: Path, name: str, num_shards: int = 1, **overrides) -> tuple[dict, Path]:
    collected = tmp_path / f"input-{num_shards}"
    if not collected.exists():
        write_stage(collected, CORPUS, num_shards)
    out_dir = tmp_path / name
    out_dir.mkdir()
    return clean_documents(CleanConfig(**overrides), collected, out_dir), out_dir


def _reasons(out: Path, kind: str) -> dict[str, str]:
    return {record["id"]: record["reason"] for record in records(out, kind)}


def _kept(out: Path) -> list[Document]:
    return list(read_shards(shard_paths(out)))


def test_clean_keeps_removes_and_accounts_exactly(tmp_path: Path) -> None:
    stats, out = _run(tmp_path, "w1", num_workers=1)

    kept = _kept(out)
    assert [d.id for d in kept] == ["en", "de", "code", "fr"]  # input order
    assert _reasons(out, "removed") == {
        "ja": "language:ja",
        "repetitive": "gopher_repetition:dup_para_frac",
        "short": "gopher_quality:gopher_short_doc",
    }
    assert _reasons(out, "quarantine") == {"blank": "empty_text"}

    inputs = {d.id: d for d in CORPUS}
    by_id = {d.id: d for d in kept}
    # not natural language: passes untouched but for its quality score (every document is scored), no language label
    code = by_id["code"]
    assert code.metadata.pop("quality_score") >= 0.0 and code == inputs["code"]
    for doc_id in ("en", "de", "fr"):
        doc, original = by_id[doc_id], inputs[doc_id]
        assert (doc.text, doc.source, doc.domain, doc.licence) == (
            original.text, original.source, original.domain, original.licence
        )
        assert doc.metadata.keys() == {"page", "language", "language_score", "quality_score"}  # all scored
        assert doc.metadata["language"] == doc_id
        assert doc.metadata["language_score"] > 0.9

    assert stats.pop("accounting") == accounting(out)  # tallied while writing: what the shards hold
    listing = stats.pop("shards")
    assert [len(listing[kind]) for kind in KINDS] == [1, 1, 1]
    assert stats.pop("executor_cpu_s") == 0  # every rank ran in this process
    assert stats == {
        "num_in": 8,
        "num_kept": 4,
        "num_removed": 3,
        "num_quarantined": 1,
        "removed": {
            "gopher_quality:gopher_short_doc": 1,
            "gopher_repetition:dup_para_frac": 1,
            "language:ja": 1,
        },
        "quarantined": {"empty_text": 1},
        "languages": {"de": 1, "en": 1, "fr": 1},
        "removed_by_filter": {
            "url_blocklist": 0, "word_blocklist": 0, "language": 1, "gopher_repetition": 1, "gopher_quality": 1,
            "c4_quality": 0, "fineweb_quality": 0, "code_rules": 0, "quality_classifier": 0,
        },
        "removed_by_domain": {"prose": {"gopher_quality": 1, "language": 1}, "web": {"gopher_repetition": 1}},
        "pii": {"num_docs_redacted": 0, "num_replacements": {"email": 0, "ip": 0, "card": 0, "phone": 0}},
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*KINDS, LISTING_FILE, STATS_FILE, "datatrove.log", "removals.json", "removals.md", "removals.png"]
    )


def test_shards_and_workers_do_not_change_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A task per input shard, two at a time: shard i of the output holds input shard i's documents, and
    the shards read in order are what one shard in one process gives."""
    stats1, out1 = _run(tmp_path, "w1", num_workers=1)
    stats3, out3 = _run(tmp_path, "w2", num_shards=3, num_workers=2)
    # the ranks' documents, counted in the workers, on this process's progress line (a plain line off a terminal)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("clean: ")]
    assert [line.split(", ")[0] for line in progress] == ["clean: 8/8 documents (100%)"] * 2
    listing1, listing3 = stats1.pop("shards"), stats3.pop("shards")
    assert [len(listing1[kind]) for kind in KINDS] == [1, 1, 1]
    assert [s["path"] for s in listing3["documents"]] == [f"documents/0000{i}.jsonl.zst" for i in range(3)]
    stats1.pop("executor_cpu_s"), stats3.pop("executor_cpu_s")
    assert stats1 == stats3
    for kind in KINDS:
        assert raw(out1, kind) == raw(out3, kind)
    assert CleanConfig(num_workers=1).identity() == CleanConfig(num_workers=2).identity()


def test_domains_choose_where_filters_apply(tmp_path: Path) -> None:
    # Japanese text in a domain without language ID passes; English rules now also judge "multilingual".
    stats, out = _run(tmp_path, "domains", language_domains=["web"], quality_domains=["web", "prose", "multilingual"])
    assert [d.id for d in _kept(out)] == ["en", "code"]
    assert _reasons(out, "removed") == {
        "ja": "gopher_quality:gopher_short_doc",  # spaCy's English tokenizer finds few "words" in Japanese
        "de": "gopher_quality:gopher_below_alpha_threshold",
        "repetitive": "gopher_repetition:dup_para_frac",
        "short": "gopher_quality:gopher_short_doc",
        "fr": "gopher_quality:gopher_enough_stop_words",
    }
    assert stats["languages"] == {"en": 1}


def test_bad_config_and_input_are_user_errors(tmp_path: Path) -> None:
    write_stage(tmp_path / "input", CORPUS)
    with pytest.raises(ConfigError, match="'xx'"):
        clean_documents(CleanConfig(languages=["en", "xx"]), tmp_path / "input", tmp_path)
    with pytest.raises(InputError, match="has no document_shards.json"):
        clean_documents(CleanConfig(), tmp_path / "missing", tmp_path)
