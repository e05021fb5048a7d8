"""The text of an HTML page: trafilatura's main-content extraction, with lxml's visible text as fallback.

trafilatura drops navigation and boilerplate; it returns nothing for pages it judges too small,
and those fall back to the whole visible text so that short pages are not lost.

Both libraries fail on some pages in ways their authors did not plan for (trafilatura 1.11:
AttributeError on an empty tree; htmldate inside it: AssertionError from lxml's `drop_tree` on
`<svg>x`; lxml: ValueError on a str that declares an encoding). A page is untrusted input, so
such a failure is an outcome here, not an exception: trafilatura's failure falls back to lxml
(and is named in the metadata), and a page lxml cannot read either is reported as unreadable
for the collect stage to quarantine.
"""

from __future__ import annotations

from typing import Any

import lxml.html
import trafilatura
from lxml.etree import LxmlError, ParserError

# Bytes with the encoding fixed: the page was already decoded as UTF-8, so a declaration inside
# it (`<?xml encoding="latin1"?>`, `<meta charset>`) is wrong here and must not re-decode it.
_UTF8_HTML = lxml.html.HTMLParser(encoding="utf-8")


class UnreadableHtml(ValueError):
    """Neither extractor can read the page."""


def extract_html(html: str) -> tuple[str, dict[str, Any]]:
    """Title + main text of a page, and its url/title/extractor as metadata; UnreadableHtml if none."""
    title = url = None
    body = ""
    metadata: dict[str, Any] = {"url": None, "title": None, "extractor": "trafilatura"}
    try:
        result = _trafilatura(html)
    except Exception as err:  # noqa: BLE001 — a library failure on one page; lxml below reads it
        result = None
        metadata["extractor_error"] = f"{type(err).__name__}: {err}"[:500]
    if result:
        title, url, body = result.get("title"), result.get("url"), result.get("text") or ""
        metadata |= {"url": url, "title": title}
    if not body.strip():
        body = _visible_text(html)
        metadata["extractor"] = "lxml"
    if title and not body.startswith(title):
        body = f"{title}\n\n{body}"
    return body, metadata


def _trafilatura(html: str) -> dict[str, Any] | None:
    # Parse first: trafilatura 1.11 raises AttributeError on a page that gives no tree.
    tree = trafilatura.load_html(html)
    if tree is None:
        return None
    return trafilatura.bare_extraction(tree, with_metadata=True, include_comments=False)


def _visible_text(html: str) -> str:
    """Every visible line of the page, scripts and styles dropped."""
    data = html.encode("utf-8")
    if not data.strip():
        return ""
    try:
        tree = lxml.html.document_fromstring(data, parser=_UTF8_HTML)
        for element in tree.xpath("//script|//style|//noscript"):
            if element.getparent() is not None:  # the root cannot be dropped (lxml asserts)
                element.drop_tree()
        text = tree.text_content()
    except ParserError:  # no document: markup without content
        return ""
    except (LxmlError, ValueError) as err:
        raise UnreadableHtml(f"{type(err).__name__}: {err}") from err
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)
