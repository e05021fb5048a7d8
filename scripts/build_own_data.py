"""Builds the corpus of `configs/examples/own-data.yaml`: a user's own data, as it usually arrives.

Real text from the bundled sample (`data/sample/`) and Kiln's own source, reshaped the way
corpora come from elsewhere: five domains (none of them the default config's), a domain field per
record, licence strings as PyPI, its classifiers and Debian write them, extra fields beside the
text, and every file format collect reads:

* `articles.jsonl` (plain jsonl): English man pages (coreutils, util-linux) and German, French and
  Spanish ones, each record with its `domain` (`manuals` or `translations`; two records carry none
  and get the source's, one says `blog`, which the source does not declare: quarantined), `lang`,
  `package` and `section`. Licences: `GPL-3+` (Debian), `License :: OSI Approved :: GNU General
  Public License v2 or later (GPLv2+)` (a trove classifier), `GPLv2+`, `BSD License`, and `Vim
  License` for vimtutor, which no table maps: reported, not guessed.
* `archive/part-0000{0,1}.jsonl.gz`: source files (`source`): CPython's standard library (`Python
  Software Foundation License`, `PSFL`), colorlog (`MIT License`) and Kiln (`Apache License,
  Version 2.0`), with `language` and `repo`.
* `tables/git-man.parquet`: git man pages (`manuals`), licence `GPLv2`, `package` and `section` columns.
* `crawl/docs.warc.gz`: Python documentation pages (`guides`) as a crawler without payload
  detection writes them: HTTP `Content-Type: text/html` and no `WARC-Identified-Payload-Type`;
  every other page is the page's body alone, which libmagic does not call HTML.
* `s3://<bucket>/notes/posts.jsonl` (plain jsonl in a bucket): git release notes (`notes`),
  licence `GPLv2`, with `version`. Without `--s3` they are written to `notes/posts.jsonl` instead.

Object-store credentials and endpoint come from the environment, as Kiln reads them
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `FSSPEC_S3_ENDPOINT_URL`); the bucket is created if
missing. The sample and Kiln's source are read from the installed Kiln (`kiln.tasks.bundled`), so the
script runs outside Kiln's checkout too. The same sample gives the same files:

    python scripts/build_own_data.py own-data [--s3 s3://kiln-own-data]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
from importlib.resources import files
from pathlib import Path

from kiln.tasks.bundled import shipped

SAMPLE = shipped("data") / "sample"
CRAWL_DATE = "2026-12-01T08:00:00Z"
NUM_MANUALS, NUM_TRANSLATIONS, NUM_CODE, NUM_GIT_MAN, NUM_PAGES, NUM_NOTES = 8, 6, 8, 10, 10, 12
# A record's real licence (SPDX) -> how this corpus writes it (tests/flows/test_own_data.py checks they agree).
WRITTEN = {
    "GPL-3.0-or-later": ("GPL-3+",),
    "GPL-2.0-or-later": ("License :: OSI Approved :: GNU General Public License v2 or later (GPLv2+)", "GPLv2+"),
    "GPL-2.0-only": ("GPLv2",),
    "BSD-3-Clause": ("BSD License",),
    "PSF-2.0": ("Python Software Foundation License", "PSFL"),
    "MIT": ("MIT License",),
    "Apache-2.0": ("Apache License, Version 2.0",),
    "Vim": ("Vim License",),
}
KILN_MODULES = ("tasks/errors.py", "tasks/accounting.py", "tasks/fingerprint.py")  # Kiln is Apache-2.0
KILN_CODE = files("kiln.tasks")  # the installed tasks/ folder (its files are named as in the checkout)


def _spelled(licence: str, index: int) -> str:
    spellings = WRITTEN[licence]
    return spellings[index % len(spellings)]


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode()


def articles() -> list[dict]:
    """Man pages in English and in translation, a domain per record, interleaved."""
    manuals = []
    for i, path in enumerate(sorted((SAMPLE / "prose/coreutils-man").glob("*.txt"))[10:10 + NUM_MANUALS]):
        manuals.append({"id": f"coreutils/{path.stem}", "text": path.read_text(), "domain": "manuals",
                        "licence": _spelled("GPL-3.0-or-later", i), "lang": "en", "package": "coreutils",
                        "section": int(path.stem.rsplit(".", 1)[-1])})
    rows = [json.loads(line) for line in (SAMPLE / "multilingual/multilingual.jsonl").open(encoding="utf-8")]
    wanted = [r for r in rows if r["metadata"]["lang"] in ("de", "fr", "es") and r["licence"] in WRITTEN]
    by_licence = {licence: [r for r in wanted if r["licence"] == licence] for licence in ("BSD-3-Clause", "Vim")}
    picked = by_licence["BSD-3-Clause"][:2] + by_licence["Vim"][:1]  # passwd and vimtutor
    picked += [r for r in wanted if r["licence"] == "GPL-2.0-or-later"][:NUM_TRANSLATIONS - len(picked)]
    translations = [{"id": r["id"], "text": r["text"], "domain": "translations", "licence": _spelled(r["licence"], i),
                     "lang": r["metadata"]["lang"], "package": r["source"]} for i, r in enumerate(picked)]
    util_linux = sorted((SAMPLE / "prose/util-linux-man").glob("*.txt"))[:3]
    fallback = [{"id": f"util-linux/{p.stem}", "text": p.read_text(), "licence": _spelled("GPL-2.0-or-later", i + 1),
                 "lang": "en", "package": "util-linux"} for i, p in enumerate(util_linux[:2])]  # no domain field
    undeclared = {"id": f"util-linux/{util_linux[2].stem}", "text": util_linux[2].read_text(), "domain": "blog",
                  "licence": "GPLv2+", "lang": "en", "package": "util-linux"}
    records = [record for pair in zip(manuals, translations + [None] * len(manuals)) for record in pair if record]
    return records[:4] + fallback + [undeclared] + records[4:]


def source_files() -> list[dict]:
    """CPython modules, colorlog and Kiln: one record per file, licences as their package indexes write them."""
    cpython = [json.loads(line) for line in (SAMPLE / "code/code.jsonl").open(encoding="utf-8")]
    cpython = [r for r in cpython if r["licence"] == "PSF-2.0" and len(r["text"]) < 6_000][:NUM_CODE]
    records = [{"id": r["id"], "text": r["text"], "licence": _spelled("PSF-2.0", i), "language": "python",
                "repo": "cpython"} for i, r in enumerate(cpython)]
    colorlog = sorted((SAMPLE / "code-tree/colorlog/colorlog").glob("*.py"))
    records += [{"id": f"colorlog/{p.name}", "text": p.read_text(), "licence": "MIT License", "language": "python",
                 "repo": "colorlog"} for p in colorlog]
    records += [{"id": f"kiln/{name}", "text": KILN_CODE.joinpath(name.removeprefix("tasks/")).read_text(), "licence": "Apache License, Version 2.0",
                 "language": "python", "repo": "kiln"} for name in KILN_MODULES]
    return records


def git_man_table() -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(SAMPLE / "tables/git-man.parquet").slice(0, NUM_GIT_MAN).to_pylist()
    assert {row["licence"] for row in table} == {"GPL-2.0-only"}
    rows = [{**row, "licence": _spelled("GPL-2.0-only", 0)} for row in table]
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


_BODY = re.compile(r"<body[^>]*>(.*)</body>", re.DOTALL | re.IGNORECASE)


def crawl() -> bytes:
    """Python documentation pages as responses with an HTTP Content-Type and no identified payload type."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    pages = sorted((SAMPLE / "web/python-docs-en").glob("*.html"))[:NUM_PAGES]
    for i, page in enumerate(pages):
        html = page.read_text(encoding="utf-8")
        body = html if i % 2 == 0 else _BODY.search(html).group(1).strip()  # a fragment: no <html>, no doctype
        headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
        record = writer.create_warc_record(f"https://docs.python.org/3.11/{page.stem.replace('__', '/')}.html",
                                           "response", payload=io.BytesIO(body.encode()), http_headers=headers,
                                           warc_headers_dict={"WARC-Date": CRAWL_DATE})
        writer.write_record(record)
    return buffer.getvalue()


def notes() -> list[dict]:
    import datasets

    rows = datasets.load_from_disk(str(SAMPLE / "hf/git-relnotes")).select(range(NUM_NOTES))
    assert set(rows["license"]) == {"GPL-2.0-only"}
    return [{"id": row["id"], "text": row["text"], "licence": "GPLv2", "version": row["version"]} for row in rows]


def build(out: Path, s3: str | None = None) -> dict[str, int]:
    """Write the corpus under `out` (and the notes under `s3`, a bucket URL); the number of records of each file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "articles.jsonl").write_bytes(_jsonl(records := articles()))
    counts = {"articles.jsonl": len(records)}
    (out / "archive").mkdir(exist_ok=True)
    code = source_files()
    for part, chunk in enumerate((code[::2], code[1::2])):
        # mtime 0: the same records give the same bytes (gzip writes the time into its header)
        (out / f"archive/part-{part:05d}.jsonl.gz").write_bytes(gzip.compress(_jsonl(chunk), mtime=0))
    counts["archive"] = len(code)
    (out / "tables").mkdir(exist_ok=True)
    (out / "tables/git-man.parquet").write_bytes(git_man_table())
    counts["tables/git-man.parquet"] = NUM_GIT_MAN
    (out / "crawl").mkdir(exist_ok=True)
    (out / "crawl/docs.warc.gz").write_bytes(crawl())
    counts["crawl/docs.warc.gz"] = NUM_PAGES
    posts = _jsonl(notes())
    if s3 is None:
        (out / "notes").mkdir(exist_ok=True)
        (out / "notes/posts.jsonl").write_bytes(posts)
    else:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(s3.rstrip("/"))
        bucket = root.split("/", 1)[0]
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        fs.pipe(f"{root}/notes/posts.jsonl", posts)
    counts["notes/posts.jsonl"] = NUM_NOTES
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (configs/examples/own-data.yaml reads own-data/)")
    parser.add_argument("--s3", help="bucket URL for the release notes (s3://kiln-own-data); without: OUT/notes/")
    args = parser.parse_args()
    for name, count in build(args.out, args.s3).items():
        print(f"{count:3d} records  {name}")
    where = f"{args.s3.rstrip('/')}/notes/posts.jsonl" if args.s3 else f"{args.out}/notes/posts.jsonl"
    print(f"release notes: {where}")


if __name__ == "__main__":
    main()
