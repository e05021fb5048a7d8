"""Decontamination against eval files: which training documents overlap, by how much, and what happens to them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.tasks.data.collect import CollectConfig, collect_documents
from kiln.tasks.data.decontaminate import DecontaminateConfig, Grams, decontaminate_documents, split_scripts, words
from kiln.tasks.data.documents import Document, read_shards, write_documents
from kiln.tasks.data.inspection import accounting
from kiln.tasks.data.shards import shard_paths
from kiln.tasks.data.sources import SourceConfig
from kiln.tasks.errors import InputError
from kiln.tasks.evals.heldout_task import write_heldout_task
from tests.fixtures.shards import raw, records, write_stage

SAMPLE = Path(__file__).parents[3] / "data" / "sample"
HELDOUT = Path(__file__).parents[3] / "data" / "evals" / "heldout.jsonl"

# Real text: paragraphs of the Apache License 2.0 (the eval passages) and of the GPL v3 preamble.
APACHE_DERIVATIVE = (
    '"Derivative Works" shall mean any work, whether in Source or Object form, that is based on (or '
    "derived from) the Work and for which the editorial revisions, annotations, elaborations, or other "
    "modifications represent, as a whole, an original work of authorship."
)
APACHE_CONTRIBUTION = (
    '"Contributor" shall mean Licensor and any individual or Legal Entity on behalf of whom a '
    "Contribution has been received by Licensor and subsequently incorporated within the Work."
)
GPL_FREEDOM = (
    "When we speak of free software, we are referring to freedom, not price. Our General Public Licenses "
    "are designed to make sure that you have the freedom to distribute copies of free software (and "
    "charge for them if you wish), that you receive source code or can get it if you want it, that you "
    "can change the software or use pieces of it in new free programs, and that you know you can do "
    "these things."
)
GPL_RIGHTS = (
    "To protect your rights, we need to prevent others from denying you these rights or asking you to "
    "surrender the rights. Therefore, you have certain responsibilities if you distribute copies of the "
    "software, or if you modify it: responsibilities to respect the freedom of others."
)
# The first 13 words of APACHE_DERIVATIVE (after normalisation) and the first 12.
THIRTEEN = '"Derivative Works" shall mean any work, whether in Source or Object form, that'
TWELVE = '"Derivative Works" shall mean any work, whether in Source or Object form,'


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _run(tmp_path: Path, docs: list[tuple[str, str]], name: str = "run", **cfg) -> tuple[dict, list, list, dict]:
    work = tmp_path / name
    out = work / "out"
    out.mkdir(parents=True)
    evals = _write_jsonl(work / "licence_qa.jsonl", [{"text": APACHE_DERIVATIVE}, {"text": APACHE_CONTRIBUTION}])
    input_file = work / "in.jsonl"
    write_documents(input_file, [Document(i, t, "prose", "prose", "GPL-3.0-or-later") for i, t in docs])
    stats = decontaminate_documents(DecontaminateConfig(**cfg), [input_file], [evals], out)
    kept, removed = records(out), records(out, "removed")
    report = json.loads((out / "contamination.json").read_text())
    assert stats["num_in"] == stats["num_kept"] + stats["num_removed"] + stats["num_quarantined"] == len(docs)
    assert stats["num_kept"] == len(kept) and stats["num_removed"] == len(removed)
    return stats, kept, removed, report


DOCS = [
    # An eval passage quoted (with case and punctuation changes) inside a longer training document.
    ("quoted", f"{GPL_FREEDOM} {APACHE_DERIVATIVE.upper().replace(',', '')} {GPL_RIGHTS}"),
    ("clean", GPL_FREEDOM),
    ("thirteen", f"{GPL_RIGHTS} {THIRTEEN}"),
    ("twelve", f"{GPL_RIGHTS} {TWELVE}"),
]


def test_n_gram_lengths_of_the_fixtures():
    assert len(words(THIRTEEN)) == 13 and len(words(TWELVE)) == 12
    assert len(words(APACHE_DERIVATIVE)) == 41


def test_documents_quoting_an_eval_passage_are_removed(tmp_path):
    stats, kept, removed, report = _run(tmp_path, DOCS)
    assert [d["id"] for d in kept] == ["clean", "twelve"]
    assert [(r["id"], r["reason"], r["metadata"]["contamination"]) for r in removed] == [
        ("quoted", "contaminated:licence_qa", {"licence_qa": 41 - 13 + 1}),
        ("thirteen", "contaminated:licence_qa", {"licence_qa": 1}),
    ]
    assert stats["removed"] == {"contaminated:licence_qa": 2}
    assert stats["contamination"] == {
        "licence_qa": {"num_docs_contaminated": 2, "num_overlapping_ngrams": 29, "contamination_rate": 0.5,
                       "num_training_docs_with_ignored_boilerplate": {}}
    }
    qa = report["benchmarks"]["licence_qa"]
    assert (qa["num_eval_docs"], qa["num_eval_docs_too_short"]) == (2, 0)
    assert qa["num_eval_ngrams"] == (41 - 12) + (len(words(APACHE_CONTRIBUTION)) - 12)
    assert qa["examples"][1] == {
        "doc_id": "thirteen",
        "ngram": "derivative works shall mean any work whether in source or object form that",
        "snippet": "… " + " ".join(words(GPL_RIGHTS)[-12:]) + " derivative works shall mean any work whether in "
        "source or object form that",
    }
    # Eval direction: only the first eval passage is found in the training data.
    assert (qa["num_eval_docs_contaminated"], qa["contamination_rate"]) == (1, 0.5)
    assert qa["contaminated_eval_docs"] == ["line 1"]
    assert json.loads((tmp_path / "run" / "out" / "contamination_rates.json").read_text()) == {"kiln_licence_qa": 0.5}
    markdown = (tmp_path / "run" / "out" / "contamination.md").read_text()
    assert "| licence_qa | 2 | 1 | 50.00% | 2 | 29 |" in markdown


def test_flag_mode_keeps_contaminated_documents_and_marks_them(tmp_path):
    stats, kept, removed, _ = _run(tmp_path, DOCS, action="flag")
    assert removed == []
    assert [(d["id"], d["metadata"].get("contamination")) for d in kept] == [
        ("quoted", {"licence_qa": 29}),
        ("clean", None),
        ("thirteen", {"licence_qa": 1}),
        ("twelve", None),
    ]
    assert stats["num_flagged"] == 2 and stats["num_kept"] == 4


def test_ngram_size_and_minimum_overlap_are_respected(tmp_path):
    stats, kept, _, _ = _run(tmp_path, DOCS, name="twelve", ngram_size=12)
    assert [d["id"] for d in kept] == ["clean"]  # a 12-word quote now matches
    stats, kept, _, report = _run(tmp_path, DOCS, name="min2", min_overlap_ngrams=2)
    assert [d["id"] for d in kept] == ["clean", "thirteen", "twelve"]  # one shared 13-gram is not enough
    # The eval direction counts any shared n-gram, whatever min_overlap_ngrams says.
    assert report["benchmarks"]["licence_qa"]["contamination_rate"] == 0.5


def test_a_passage_many_training_documents_hold_still_counts(tmp_path):
    # A benchmark item copied widely is the worst contamination: how often it occurs is no excuse.
    docs = [("a", f"{GPL_RIGHTS} {THIRTEEN}"), ("b", f"{GPL_FREEDOM} {THIRTEEN}"), ("c", f"{THIRTEEN} {GPL_RIGHTS}")]
    stats, kept, _, report = _run(tmp_path, docs, name="common")
    assert kept == [] and stats["removed"] == {"contaminated:licence_qa": 3}
    assert report["benchmarks"]["licence_qa"]["ignored"] == {}


# The GPL v3 notice (in Kiln's known boilerplate) with years and a name that differ from the list's.
GPL_NOTICE = (
    "Copyright (C) 2019 Jane Doe. This program is free software: you can redistribute it and/or modify it under "
    "the terms of the GNU General Public License as published by the Free Software Foundation, either version 3 of "
    "the License, or (at your option) any later version."
)


def _run_evals(tmp_path: Path, evals: list[str], docs: list[tuple[str, str]], **cfg) -> tuple[dict, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    eval_file = _write_jsonl(tmp_path / "qa.jsonl", [{"id": f"q{i}", "text": t} for i, t in enumerate(evals)])
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document(i, t, "prose", "prose", "GPL-3.0-or-later") for i, t in docs])
    (tmp_path / "out").mkdir()
    stats = decontaminate_documents(DecontaminateConfig(**cfg), [input_file], [eval_file], tmp_path / "out")
    return stats, json.loads((tmp_path / "out" / "contamination.json").read_text())["benchmarks"]["qa"]


def test_known_licence_text_in_an_eval_item_is_boilerplate_and_reported_with_examples(tmp_path):
    evals = [f"{APACHE_DERIVATIVE} {GPL_NOTICE.upper()}"]
    docs = [("licensed", f"A tool for sorting files.\n\n{GPL_NOTICE.replace('2019 Jane Doe', '2003 John Roe')}"),
            ("quoting", APACHE_DERIVATIVE)]
    stats, report = _run_evals(tmp_path / "known", evals, docs)
    assert stats["removed"] == {"contaminated:qa": 1} and report["examples"][0]["doc_id"] == "quoting"
    assert report["num_eval_ngrams_boilerplate"]["known_boilerplate"] >= 25
    ignored = report["ignored"]["known_boilerplate"]
    assert ignored["num_training_docs"] == 1 and ignored["examples"][0]["doc_id"] == "licensed"
    assert "general public license" in ignored["examples"][0]["ngram"]
    assert stats["contamination"]["qa"]["num_training_docs_with_ignored_boilerplate"] == {"known_boilerplate": 1}
    # Without the list, the licence notice alone removes the document that carries it.
    stats, report = _run_evals(tmp_path / "bare", evals, docs, known_boilerplate=False)
    assert stats["removed"] == {"contaminated:qa": 2} and report["ignored"] == {}


def test_configured_boilerplate_files_and_text_frequent_across_eval_items(tmp_path):
    footer = "Questions about this manual go to the documentation team at the address printed on the back cover."
    evals = [f"{APACHE_DERIVATIVE} {footer}", f"{APACHE_CONTRIBUTION} {footer}", f"{GPL_RIGHTS} {footer}"]
    docs = [("footer", f"A page about printers. {footer}")]
    # The footer is in all three eval items: template text of the eval set, not a leaked item.
    stats, report = _run_evals(tmp_path / "frequent", evals, docs)
    assert stats["num_removed"] == 0 and report["ignored"]["eval_frequent"]["num_training_docs"] == 1
    stats, _ = _run_evals(tmp_path / "counted", evals, docs, eval_boilerplate_min_docs=4)
    assert stats["num_removed"] == 1
    # Or the user names it: a file of footers, one paragraph each.
    footers = tmp_path / "footers.txt"
    footers.write_text(f"# our documentation footers\n{footer}\n\nAnother footer of ours.\n", encoding="utf-8")
    stats, report = _run_evals(tmp_path / "configured", evals, docs, eval_boilerplate_min_docs=4,
                               boilerplate_files=[str(footers)])
    assert stats["num_removed"] == 0 and set(report["ignored"]) == {"configured_boilerplate"}
    with pytest.raises(InputError, match=r"decontaminate.boilerplate_files\[0\]: .*nowhere.txt does not exist"):
        _run_evals(tmp_path / "missing", evals, docs, boilerplate_files=[str(tmp_path / "nowhere.txt")])


def test_copies_in_other_case_layout_or_accents_match():
    assert words("İSTANBUL'da ılık bir GÜN") == words("istanbulda ILIK bir gün") == ["istanbulda", "ilik", "bir", "gun"]
    assert words("Straße\n\n  and\tmore") == words("STRASSE AND MORE")


def test_scripts_without_spaces_give_characters_and_the_rest_words():
    assert split_scripts(words("Python3のリリース、2024年 Released")) == (
        ["python3", "2024", "released"], list("のリリース年"))
    assert split_scripts(words("ภาษาไทย and 中文")) == (["and"], list("ภาษาไทย中文"))
    assert split_scripts(words("한국어 문장은 띄어 씁니다")) == (["한국어", "문장은", "띄어", "씁니다"], [])  # Hangul: spaced
    # A copy re-wrapped, in another width or case, has the same character n-grams.
    zh = "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心，并应以兄弟关系的精神相对待。"
    copy = "ＡＢＣ " + zh[:20] + "\n  " + zh[20:]
    assert Grams.of(zh, 13, 10).char_grams.keys() <= Grams.of(copy.lower(), 13, 10).char_grams.keys()
    assert len(Grams.of(zh, 13, 10).char_grams) == len(split_scripts(words(zh))[1]) - 10 + 1


def test_eval_texts_shorter_than_one_ngram_are_reported(tmp_path):
    evals = _write_jsonl(tmp_path / "short.jsonl", [{"text": TWELVE}, {"text": APACHE_CONTRIBUTION}])
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document("d", GPL_RIGHTS, "s", "prose", "MIT")])
    (tmp_path / "out").mkdir()
    decontaminate_documents(DecontaminateConfig(), [input_file], [evals], tmp_path / "out")
    report = json.loads((tmp_path / "out" / "contamination.json").read_text())
    assert report["benchmarks"]["short"]["num_eval_docs_too_short"] == 1


def test_missing_or_bad_eval_files_are_input_errors_naming_them(tmp_path):
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document("d", GPL_RIGHTS, "s", "prose", "MIT")])
    (tmp_path / "out").mkdir()
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(InputError, match="nowhere.jsonl"):
        decontaminate_documents(DecontaminateConfig(), [input_file], [missing], tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": GPL_RIGHTS}) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"bad.jsonl:2 is not valid JSON"):
        decontaminate_documents(DecontaminateConfig(), [input_file], [bad], tmp_path / "out")
    no_text = _write_jsonl(tmp_path / "no_text.jsonl", [{"question": GPL_RIGHTS}])
    with pytest.raises(InputError, match=r'no_text.jsonl:1 has no string "text" field'):
        decontaminate_documents(DecontaminateConfig(), [input_file], [no_text], tmp_path / "out")


def test_decontaminating_the_collected_prose_finds_the_leaked_eval_documents(tmp_path):
    """The bundled corpus copies 3 held-out eval documents into its prose (SOURCES.json: leaked_eval_ids)."""
    manifest = json.loads((SAMPLE / "SOURCES.json").read_text())
    leaked_ids = manifest["leaked_eval_ids"]
    sources = [
        SourceConfig(name=folder, path=str(SAMPLE / folder), format="txt", domain="prose", licence=info["licence"])
        for folder, info in manifest["folders"].items()
        if folder.startswith("prose/")
    ]
    (tmp_path / "collected").mkdir()
    collect_documents(CollectConfig(sources=sources), tmp_path / "collected")
    collected = shard_paths(tmp_path / "collected")
    training = {doc.id: doc.text for doc in read_shards(collected)}
    eval_texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in HELDOUT.read_text().splitlines()}
    holders = sorted(doc_id for doc_id, text in training.items() if any(eval_texts[i] in text for i in leaked_ids))
    assert len(training) == 188  # binutils' pages (GFDL) are not collected by default
    assert holders == [f"prose/coreutils-man/{i.rsplit('/', 1)[1]}.txt" for i in sorted(leaked_ids)]

    def run(name: str, **cfg) -> tuple[list[str], dict]:
        out = tmp_path / name
        out.mkdir()
        stats = decontaminate_documents(DecontaminateConfig(**cfg), collected, [HELDOUT], out)
        removed = [record["id"] for record in records(out, "removed")]
        heldout = json.loads((out / "contamination.json").read_text())["benchmarks"]["heldout"]
        assert stats["num_removed"] == len(removed) == heldout["num_docs_contaminated"]
        assert heldout["contaminated_eval_docs"] == sorted(leaked_ids)  # the eval direction finds them always
        assert json.loads((out / "contamination_rates.json").read_text()) == {"kiln_heldout": 3 / 63}
        return removed, heldout

    # The leaked pages share 100-129 13-grams with their eval copies. Other coreutils pages share
    # option descriptions with them (mkfifo/mknod with mkdir) or a line such as `-z, --zero ...`.
    removed, heldout = run("strict", min_overlap_ngrams=50)
    assert removed == holders
    removed, heldout = run("defaults")  # the licence notice and the GNU footer are known boilerplate
    assert len(removed) == 8 and set(holders) <= set(removed)
    assert all(doc_id.startswith("prose/coreutils-man/") for doc_id in removed)
    known = heldout["ignored"]["known_boilerplate"]
    assert known["num_training_docs"] == 106  # every coreutils page carries the footer: none removed for it
    removed, _ = run("boilerplate_counts", known_boilerplate=False, eval_boilerplate_min_docs=None)
    assert len(removed) == 106 and all(doc_id.startswith("prose/coreutils-man/") for doc_id in removed)


def test_lm_eval_tasks_are_indexed_through_the_task_manager(tmp_path):
    # A real lm-eval task (Kiln's held-out task format: json data, loglikelihood_rolling on `text`).
    evals = _write_jsonl(tmp_path / "licence_qa.jsonl", [{"text": APACHE_DERIVATIVE}, {"text": APACHE_CONTRIBUTION}])
    write_heldout_task(evals, tmp_path / "tasks", "licence_task")
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document(i, t, "prose", "prose", "GPL-3.0-or-later") for i, t in DOCS])
    (tmp_path / "out").mkdir()
    stats = decontaminate_documents(DecontaminateConfig(), [input_file], [], tmp_path / "out",
                                    eval_tasks=["licence_task"], task_include_path=tmp_path / "tasks")
    assert stats["removed"] == {"contaminated:licence_task": 2}
    report = json.loads((tmp_path / "out" / "contamination.json").read_text())["benchmarks"]["licence_task"]
    assert (report["source"], report["num_eval_docs"]) == ("lm-eval:licence_task", 2)
    assert report["contaminated_eval_docs"] == ["licence_task/0"]
    assert json.loads((tmp_path / "out" / "contamination_rates.json").read_text()) == {"licence_task": 0.5}


def test_hub_tasks_offline_are_input_errors_naming_the_task(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    # What flows/environment.py sets for every run: nothing is fetched from the hub.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub_arc.yaml").write_text(
        "task: hub_arc\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{choices.label.index(answerKey)}}'\n"
        "doc_to_choice: '{{choices.text}}'\n",
        encoding="utf-8",
    )
    input_file = tmp_path / "in.jsonl"
    write_documents(input_file, [Document("d", GPL_RIGHTS, "s", "prose", "MIT")])
    (tmp_path / "out").mkdir()
    with pytest.raises(InputError, match=r"lm-eval task 'hub_arc'.*need network access"):
        decontaminate_documents(DecontaminateConfig(), [input_file], [], tmp_path / "out",
                                eval_tasks=["hub_arc"], task_include_path=tmp_path / "tasks")


def test_removal_report_counts_documents_and_bytes_by_domain(tmp_path):
    work = tmp_path / "run"
    (work / "out").mkdir(parents=True)
    evals = _write_jsonl(work / "licence_qa.jsonl", [{"text": APACHE_DERIVATIVE}])
    docs = [Document("quoted", f"{GPL_FREEDOM} {APACHE_DERIVATIVE}", "s", "web", "MIT"),
            Document("clean", GPL_FREEDOM, "s", "web", "MIT"), Document("rights", GPL_RIGHTS, "s", "prose", "MIT")]
    write_documents(work / "in.jsonl", docs)
    stats = decontaminate_documents(DecontaminateConfig(), [work / "in.jsonl"], [evals], work / "out")
    size = {d.id: len(d.text.encode()) for d in docs}
    assert stats["accounting"] == {
        "prose": {"in": {"docs": 1, "bytes": size["rights"]}, "kept": {"docs": 1, "bytes": size["rights"]},
                  "removed": {}, "quarantined": {}},
        "web": {"in": {"docs": 2, "bytes": size["quoted"] + size["clean"]}, "kept": {"docs": 1, "bytes": size["clean"]},
                "removed": {"contaminated": {"docs": 1, "bytes": size["quoted"]}}, "quarantined": {}},
    }
    assert stats["accounting"] == accounting(work / "out") == json.loads((work / "out" / "removals.json").read_text())
    assert "| web | removed | contaminated | 1 |" in (work / "out" / "removals.md").read_text()
    assert (work / "out" / "removals.png").read_bytes()[:4] == b"\x89PNG"


def test_shards_scanned_in_parallel_give_what_one_shard_gives(tmp_path):
    """The eval index is built once; each shard is scanned as a task, two at a time. The shards read in
    order, the reports and their examples (the first ones in input order) equal one shard's."""
    evals = _write_jsonl(tmp_path / "licence_qa.jsonl", [{"text": APACHE_DERIVATIVE}, {"text": APACHE_CONTRIBUTION}])
    docs = [Document(f"{i}-{doc_id}", text, "s", "prose", "MIT") for i in range(4) for doc_id, text in DOCS]
    outputs = []
    for num_shards, workers in ((1, 1), (3, 2)):
        out = tmp_path / f"out-{num_shards}"
        out.mkdir()
        inputs = shard_paths(write_stage(tmp_path / f"in-{num_shards}", docs, num_shards))
        stats = decontaminate_documents(DecontaminateConfig(num_workers=workers), inputs, [evals], out)
        stats.pop("shards"), stats.pop("executor_cpu_s")
        outputs.append((stats, raw(out), raw(out, "removed"), (out / "contamination.json").read_text(),
                        (out / "contamination_rates.json").read_text()))
    assert outputs[0] == outputs[1]
    assert outputs[0][0]["removed"] == {"contaminated:licence_qa": 8}
    assert [e["doc_id"] for e in json.loads(outputs[0][3])["benchmarks"]["licence_qa"]["examples"]] == [
        "0-quoted", "0-thirteen", "1-quoted", "1-thirteen", "2-quoted"]


# Mixed-script eval items (issue 34): Chinese and Japanese technical text interleaved with Latin terms,
# paths, identifiers and versions. Each holds fewer than 50 unspaced characters, so character n-grams of
# the unspaced characters alone never formed one, and fewer than 13 Latin words: nothing found it.
ZH_NETWORK = (
    "在 Ubuntu 22.04 上配置静态地址时，先用 sudo 编辑 /etc/network/interfaces 文件，把 eth0 的 "
    "iface 设为 static，再运行 systemctl restart networking 使配置生效，最后检查地址是否正确，并重新启动服务器。"
)
ZH_CODE = (
    "调用 torch.nn.functional.scaled_dot_product_attention 时，如果 attn_mask 的形状与 query 不一致，"
    "PyTorch 2.1 会抛出 RuntimeError；请先检查 batch_size、num_heads 和 seq_len 三个维度"
    "是否与模型的配置完全一致，然后重新运行训练脚本。"
)
JA_DOCKER = (
    "Dockerコンテナを起動するには、docker run -it --rm ubuntu:22.04 bash を実行します。"
    "イメージがない場合はdocker pullで取得し、docker psでコンテナの状態を確認してください。"
)
MIXED_ITEMS = {"zh_network": ZH_NETWORK, "zh_code": ZH_CODE, "ja_docker": JA_DOCKER}


def _as_pasted(text: str) -> str:
    """The item as a web page or wiki carries it: non-breaking spaces around the Latin words, a zero-width
    space and a soft hyphen inside, full-width punctuation and another line wrapping."""
    text = text.replace(" ", "\u00a0").replace("，", ",\n").replace("。", "．")
    return text.replace("network", "net\u00adwork").replace("docker", "\u200bdocker", 1)


def test_mixed_script_text_gives_one_token_per_latin_word_inside_character_ngrams():
    from kiln.tasks.data.decontaminate import mixed_tokens

    tokens = words("用python3运行 /etc/network/interfaces 文件")
    assert split_scripts(tokens) == (["python3", "etcnetworkinterfaces"], list("用运行文件"))
    assert mixed_tokens(tokens) == ["用", "python3", "运", "行", "etcnetworkinterfaces", "文", "件"]
    assert mixed_tokens(words("only latin words here")) == []
    for item in MIXED_ITEMS.values():
        spaced, unspaced = split_scripts(words(item))
        assert len(unspaced) < 50 and len(spaced) < 13  # neither kind of n-gram of old formed
        assert len(mixed_tokens(words(item))) >= 50
        assert Grams.of(item, 13, 50).char_grams  # the mixed tokens do
    # Pure CJK text keeps exactly its old character n-grams; a window of Latin words alone is no character n-gram.
    zh = "人人生而自由，在尊严和权利上一律平等。他们赋有理性和良心，并应以兄弟关系的精神相对待。"
    assert len(Grams.of(zh, 13, 10).char_grams) == len(split_scripts(words(zh))[1]) - 10 + 1
    latin_then_cjk = " ".join(["word"] * 20) + " 中文"
    assert len(Grams.of(latin_then_cjk, 13, 5).char_grams) == 2  # the windows ending in 中 and in 文


def test_mixed_script_items_pasted_with_nbsp_zero_width_and_other_punctuation_are_found(tmp_path):
    train = [
        ("zh_blog", "网络配置笔记。\n" + _as_pasted(ZH_NETWORK) + "\nThat is all for today."),
        ("zh_forum", "Q: attention error\n\n" + _as_pasted(ZH_CODE).upper()),
        ("ja_wiki", "## 手順\n\n" + _as_pasted(JA_DOCKER) + "\n\n以上です。"),
        # the same Chinese and Japanese sentences about other software: every Latin word differs
        ("zh_other", ZH_NETWORK.replace("Ubuntu 22.04", "Debian 12").replace("sudo", "doas")
         .replace("/etc/network/interfaces", "/etc/systemd/network/10-eth.network").replace("eth0", "enp3s0")
         .replace("iface", "Address").replace("static", "manual").replace("systemctl restart networking",
                                                                            "networkctl reload now")
         ),
        ("ja_other", JA_DOCKER.replace("Docker", "Podman").replace("docker", "podman")
         .replace("-it --rm ubuntu:22.04 bash", "-d --name web nginx:1.25 sh")),
        ("english", GPL_FREEDOM),
    ]
    work = tmp_path / "mixed"
    (work / "out").mkdir(parents=True)
    evals = work / "mixed_qa.jsonl"
    evals.write_text("".join(json.dumps({"id": name, "text": text}, ensure_ascii=False) + "\n"
                             for name, text in MIXED_ITEMS.items()), encoding="utf-8")
    write_documents(work / "in.jsonl", [Document(i, t, "web", "multilingual", "MIT") for i, t in train])
    stats = decontaminate_documents(DecontaminateConfig(), [work / "in.jsonl"], [evals], work / "out")
    assert sorted(r["id"] for r in records(work / "out", "removed")) == ["ja_wiki", "zh_blog", "zh_forum"]
    assert stats["num_kept"] == 3
    report = json.loads((work / "out" / "contamination.json").read_text())["benchmarks"]["mixed_qa"]
    assert sorted(report["contaminated_eval_docs"]) == sorted(MIXED_ITEMS)
    assert report["num_eval_docs_too_short"] == 0
