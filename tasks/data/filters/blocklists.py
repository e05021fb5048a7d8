"""Sensitive-content blocklists the user supplies: URLs/domains and words/phrases, one per line.

A list file is UTF-8 text, one entry per line; blank lines and lines starting with `#` are
ignored; matching ignores case. The list's name (its file name without the extension) is the
removal reason, so the removed records say which list a document was on.
- URL list: an entry without `/` is a domain and blocks that host and its subdomains
  (`example.com` blocks `www.example.com`, not `badexample.com`); an entry with `/` is a URL
  prefix, compared without the scheme (`example.com/private/` blocks everything below it).
  Documents are judged by their `url` metadata (html pages have one); documents without a URL pass.
- Word list: a document containing any entry as a whole word or phrase is removed
  (`ass` matches "ass" and "ASS", not "class" or "assume"; whitespace inside a phrase matches
  any whitespace).
Nothing is downloaded: these replace datatrove's `URLFilter`/`C4BadWordsFilter` lists, which are.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from datatrove.data import Document as DtDocument
from datatrove.pipeline.filters.base_filter import BaseFilter

from kiln.tasks.errors import ConfigError


def read_blocklist(path: str, setting: str) -> tuple[str, list[str]]:
    """The list's name and its entries (lower-cased), or a ConfigError naming `setting`."""
    list_path = Path(path)
    if not list_path.is_file():
        raise ConfigError(f"{setting}: {list_path} does not exist; point it at a text file with one entry a line, "
                          f"or set {setting}=null")
    try:
        lines = list_path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{setting}: {list_path} is not UTF-8 text") from None
    entries = [line.strip().lower() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not entries:
        raise ConfigError(f"{setting}: {list_path} has no entries (only blank and # lines); "
                          f"add entries or set {setting}=null")
    return list_path.stem, entries


class URLBlocklistFilter(BaseFilter):
    """Removes documents whose `url` metadata is on the list; the reason is the list's name."""

    name = "⛔ URL blocklist"

    def __init__(self, list_name: str, entries: list[str], exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.list_name = list_name
        self.domains = frozenset(e.strip(".") for e in entries if "/" not in e) - {""}
        self.prefixes = tuple(e.split("://", 1)[-1] for e in entries if "/" in e)

    def blocked(self, url: str) -> bool:
        try:
            host = (urlsplit(url if "://" in url else f"//{url}").hostname or "").rstrip(".")
        except ValueError:  # e.g. "http://[::1" (an unclosed IPv6 host): no host, prefixes may still match
            host = ""
        labels = host.split(".")
        if any(".".join(labels[i:]) in self.domains for i in range(len(labels))):
            return True
        return url.split("://", 1)[-1].lower().startswith(self.prefixes)

    def filter(self, doc: DtDocument) -> bool | tuple[bool, str]:
        url = doc.metadata.get("url")  # input metadata: anything a jsonl record carried
        return not (isinstance(url, str) and self.blocked(url)) or (False, self.list_name)


class WordBlocklistFilter(BaseFilter):
    """Removes documents containing any listed word or phrase; the reason is the list's name."""

    name = "⛔ Word blocklist"

    def __init__(self, list_name: str, entries: list[str], exclusion_writer=None):
        super().__init__(exclusion_writer)
        self.list_name = list_name
        # Longest first, so that a phrase wins over the word it starts with; \w edges, not \b,
        # so that entries which begin or end in punctuation still match.
        alternatives = (r"\s+".join(map(re.escape, e.split())) for e in sorted(set(entries), key=len, reverse=True))
        self.pattern = re.compile(r"(?<!\w)(?:" + "|".join(alternatives) + r")(?!\w)", re.IGNORECASE)

    def filter(self, doc: DtDocument) -> bool | tuple[bool, str]:
        return self.pattern.search(doc.text) is None or (False, self.list_name)
