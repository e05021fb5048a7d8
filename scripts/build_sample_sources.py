"""Builds the bundled samples of Kiln's other source formats, and the quality classifier's reference set.

Beside the folders of `scripts/build_sample_corpus.py` (html, txt, jsonl), the default run reads
one small sample of every other format collect can bundle, each real upstream text:

* `data/sample/warc/python-howto.warc.gz`: Python 3.11 HOWTO pages (`python3.11-doc`, PSF-2.0)
  written as a crawl writes them: a warcinfo record, then a request and a response record per
  URL under https://docs.python.org/3.11/, plus one plain-text response (the page's reST source,
  which no HTML extractor should read). The crawl date is the fixed `CRAWL_DATE`.
* `data/sample/tables/git-man.parquet`: git man pages (`git-man`, GPL-2.0-only) rendered with
  `man -l -P cat`, one row each (text, id, licence, package, section).
* `data/sample/compressed/git-man-{1.jsonl.gz,2.jsonl.zst}`: more git man pages, as gzip and
  zstandard jsonl; the zstd file spells its field `license` (American), as many datasets do.
* `data/sample/hf/git-relnotes/`: git release notes (`/usr/share/doc/git/RelNotes`) as a
  Hugging Face dataset written by `Dataset.save_to_disk` (Arrow files, read by `datasets`).
* `data/sample/code-tree/colorlog/`: the source tree of colorlog 6.12 (MIT) as installed in the
  project's virtual environment: its LICENSE, its modules, `py.typed` and one compiled module,
  `wrappers.pyc` beside its source as `compileall -b` writes it (binary: skipped by collect). Not in
  `__pycache__/`: collect reads no bytecode cache (pip fills it when it installs Kiln's wheel).
* `data/sample/references/python-language-reference.jsonl`: the Python 3.11.7 Language Reference
  as shipped in CPython's `pydoc_data/topics.py` (PSF-2.0): the high-quality reference set the
  clean stage's classifier trains its positives on (`tasks/data/quality_training.py`).

Man pages in `data/evals/heldout.jsonl` are left out. Sorted walks and fixed dates make a rerun
on the same machine rebuild identical files (the Arrow and parquet writers embed no timestamps):

    python scripts/build_sample_sources.py [--data-dir data] [--deb-dir /tmp/kiln-debs]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from build_sample_corpus import render_all, require, truncate  # noqa: E402

CRAWL_DATE = "2026-11-20T09:00:00Z"
HOWTO_PAGES = ("annotations", "instrumentation", "ipaddress", "sockets", "sorting", "pyporting")
MAX_MAN_CHARS = 8_000
GIT_MAN = Path("/usr/share/man/man1")
GIT_LICENCE = "GPL-2.0-only"  # git's debian/copyright: Files: * License: GPL-2
NUM_PARQUET, NUM_GZ, NUM_ZST = 14, 10, 10
RELNOTES = Path("/usr/share/doc/git/RelNotes")
NUM_RELNOTES = 16
PYENV_TOPICS = Path("/root/.pyenv/versions/3.11.7/lib/python3.11/pydoc_data/topics.py")
MAX_REFERENCE_CHARS = 6_000


def _heldout_ids(data: Path) -> set[str]:
    return {json.loads(line)["id"].rsplit("/", 1)[-1] for line in (data / "evals/heldout.jsonl").open()}


def build_warc(out: Path, deb_dir: Path) -> None:
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    html_root = _python_doc(deb_dir) / "usr/share/doc/python3.11/html"
    pages = [(f"howto/{name}.html", (html_root / f"howto/{name}.html").read_bytes(), "text/html; charset=utf-8")
             for name in HOWTO_PAGES]
    pages.append(("_sources/howto/sorting.rst.txt", (html_root / "_sources/howto/sorting.rst.txt").read_bytes(),
                  "text/plain; charset=utf-8"))
    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=True)
    date = {"WARC-Date": CRAWL_DATE}
    info = writer.create_warcinfo_record("python-howto.warc.gz", {"software": "kiln scripts/build_sample_sources.py",
                                                                  "description": "Python 3.11 HOWTOs from python3.11-doc"})
    info.rec_headers.replace_header("WARC-Date", CRAWL_DATE)
    info.rec_headers.replace_header("WARC-Record-ID", _record_id("python-howto.warc.gz", "warcinfo"))
    writer.write_record(info)
    for rel, body, content_type in pages:
        url = f"https://docs.python.org/3.11/{rel}"
        request = writer.create_warc_record(url, "request", payload=io.BytesIO(b""), warc_headers_dict=date,
                                            http_headers=StatusAndHeaders(f"GET /3.11/{rel} HTTP/1.1",
                                                                          [("Host", "docs.python.org")], is_http_request=True))
        headers = StatusAndHeaders("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))],
                                   protocol="HTTP/1.1")
        response = writer.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=headers,
                                             warc_headers_dict=date)
        for record in (request, response):
            record.rec_headers.replace_header("WARC-Record-ID", _record_id(url, record.rec_type))
            writer.write_record(record)
    (out / "warc").mkdir(parents=True, exist_ok=True)
    (out / "warc/python-howto.warc.gz").write_bytes(buffer.getvalue())


def _record_id(url: str, kind: str) -> str:
    """A stable WARC-Record-ID (warcio draws a random uuid4): a uuid5 of the URL and record type."""
    import uuid

    return f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, f'{kind} {url}')}>"


def _python_doc(deb_dir: Path) -> Path:
    target = deb_dir / "x" / "python3.11-doc"
    if not target.is_dir():
        if not list(deb_dir.glob("python3.11-doc_*.deb")):
            subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=deb_dir, check=True, capture_output=True)
        (deb,) = sorted(deb_dir.glob("python3.11-doc_*.deb"))
        target.mkdir(parents=True)
        subprocess.run(["dpkg", "-x", str(deb), str(target)], check=True)
    require(target / "usr/share/doc/python3.11-doc/copyright", "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    return target


def git_man_records(data: Path) -> list[dict]:
    require(Path("/usr/share/doc/git-man/copyright"), "License: GPL-2")
    heldout = _heldout_ids(data)
    pages = [p for p in sorted(GIT_MAN.glob("git-*.1.gz")) if p.name.removesuffix(".gz") not in heldout]
    # Spread over the alphabet, skipping the very long pages (git-config, git-rebase) the cut would mangle.
    texts = render_all(pages)
    chosen = [(p, t) for p, t in zip(pages, texts) if 1_500 <= len(t) <= 20_000]
    step = max(1, len(chosen) // (NUM_PARQUET + NUM_GZ + NUM_ZST))
    chosen = chosen[::step][: NUM_PARQUET + NUM_GZ + NUM_ZST]
    return [{"id": f"git-man/{p.name.removesuffix('.gz')}", "text": truncate(t, MAX_MAN_CHARS), "licence": GIT_LICENCE,
             "package": "git-man", "section": 1} for p, t in chosen]


def build_tables(out: Path, records: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (out / "tables").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records[:NUM_PARQUET]), out / "tables/git-man.parquet", compression="zstd")
    (out / "compressed").mkdir(parents=True, exist_ok=True)
    gz = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[NUM_PARQUET:NUM_PARQUET + NUM_GZ])
    (out / "compressed/git-man-1.jsonl.gz").write_bytes(gzip.compress(gz.encode(), mtime=0))
    american = [{("license" if k == "licence" else k): v for k, v in r.items()} for r in records[NUM_PARQUET + NUM_GZ:]]
    zst = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in american)
    (out / "compressed/git-man-2.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=19).compress(zst.encode()))


def build_dataset(out: Path) -> None:
    import datasets

    notes = sorted(RELNOTES.glob("2.*.txt"), key=lambda p: [int(x) for x in p.stem.split(".")])
    notes = [p for p in notes if len(p.read_text(encoding="utf-8")) >= 3_000][-NUM_RELNOTES:]
    rows = {"id": [f"git-relnotes/{p.stem}" for p in notes],
            "text": [truncate(p.read_text(encoding="utf-8"), MAX_MAN_CHARS) for p in notes],
            "version": [p.stem for p in notes], "license": [GIT_LICENCE] * len(notes)}
    target = out / "hf/git-relnotes"
    shutil.rmtree(target, ignore_errors=True)
    datasets.Dataset.from_dict(rows).save_to_disk(str(target))
    # save_to_disk records a fingerprint drawn from the data and a random seed: drop what makes rebuilds differ
    state = json.loads((target / "state.json").read_text())
    state["_fingerprint"] = "kiln-sample"
    (target / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def build_code_tree(out: Path) -> None:
    import colorlog

    package = Path(colorlog.__file__).parent
    (dist_info,) = package.parent.glob("colorlog-*.dist-info")
    target = out / "code-tree/colorlog"
    shutil.rmtree(target, ignore_errors=True)
    (target / "colorlog").mkdir(parents=True)
    shutil.copy(dist_info / "licenses/LICENSE", target / "LICENSE")
    for module in sorted(package.glob("*.py")) + [package / "py.typed"]:
        shutil.copy(module, target / "colorlog" / module.name)
    (pyc,) = package.glob("__pycache__/wrappers.cpython-311.pyc")
    shutil.copy(pyc, target / "colorlog" / "wrappers.pyc")


def build_references(out: Path) -> None:
    require(Path("/usr/share/doc/python3.11/copyright"), "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    namespace: dict = {}
    exec(compile(PYENV_TOPICS.read_text(encoding="utf-8"), str(PYENV_TOPICS), "exec"), namespace)  # a dict literal
    records = [{"id": f"python-reference/{name}", "text": truncate(text, MAX_REFERENCE_CHARS), "licence": "PSF-2.0"}
               for name, text in sorted(namespace["topics"].items()) if len(text) >= 1_000]
    (out / "references").mkdir(parents=True, exist_ok=True)
    with open(out / "references/python-language-reference.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


ATTRIBUTION = """# Attribution of the other-format samples and the reference set

Built by `scripts/build_sample_sources.py` (see `data/ATTRIBUTION.md` for the html, txt and jsonl
samples). All text is real upstream text, cut at a paragraph break where long; nothing else edited.

| file | upstream | copyright holders | licence |
|---|---|---|---|
| data/sample/warc/python-howto.warc.gz | python3.11-doc (Debian 3.11.2), HOWTO pages | Python Software Foundation | PSF-2.0 |
| data/sample/tables/git-man.parquet, data/sample/compressed/* | git-man (Debian), man pages rendered by man(1) | 2005-2022 Linus Torvalds and others | GPL-2.0-only |
| data/sample/hf/git-relnotes/ | git (Debian), /usr/share/doc/git/RelNotes | 2005-2022 Linus Torvalds and others | GPL-2.0-only |
| data/sample/code-tree/colorlog/ | colorlog 6.12.0 (PyPI wheel) | 2012-2021 Sam Clements | MIT |
| data/sample/references/python-language-reference.jsonl | CPython 3.11.7 Lib/pydoc_data/topics.py | Python Software Foundation | PSF-2.0 |
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO / "data")
    parser.add_argument("--deb-dir", type=Path, default=Path("/tmp/kiln-debs"))
    args = parser.parse_args()
    args.deb_dir.mkdir(parents=True, exist_ok=True)
    sample = args.data_dir / "sample"
    build_warc(sample, args.deb_dir)
    build_tables(sample, git_man_records(args.data_dir))
    build_dataset(sample)
    build_code_tree(sample)
    build_references(sample)
    (args.data_dir / "ATTRIBUTION-formats.md").write_text(ATTRIBUTION, encoding="utf-8")
    for path in sorted(p for p in sample.rglob("*") if p.is_file() and p.stat().st_mtime and
                       p.relative_to(sample).parts[0] in ("warc", "tables", "compressed", "hf", "code-tree", "references")):
        print(f"{path.relative_to(args.data_dir)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
