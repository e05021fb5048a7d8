"""The C4 and FineWeb quality rules for natural-language text, as datatrove implements them.

Both are English web-text heuristics (Penedo et al. 2024, FineWeb; Raffel et al. 2020, C4) and
apply only to their configured domains. C4's filter also *rewrites* documents, dropping lines
(those without terminal punctuation, under 3 words, mentioning javascript or cookie policies)
and joining what is left with single newlines. Here it only judges: a document is kept or removed
whole and its text is never changed, because on documentation and manual pages the dropped
"lines" are headings, option lists and code samples, and the joined text loses its paragraphs.
The line rules still decide which lines count towards `min_num_sentences`.
"""

from __future__ import annotations

from datatrove.data import Document as DtDocument
from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter
from pydantic import Field

from kiln.tasks.configbase import Section, names_field


class C4Rules(Section):
    """clean.c4: datatrove's C4QualityFilter with FineWeb's settings (no terminal-punctuation rule)."""

    domains: list[str] = names_field("domain", ["web", "prose"])
    filter_no_terminal_punct: bool = False  # True is the C4 paper's rule; FineWeb turned it off
    min_num_sentences: int = Field(default=5, ge=-1)  # in lines the line rules keep; -1: off
    min_words_per_line: int = Field(default=3, ge=-1)  # shorter lines do not count; -1: off
    filter_lorem_ipsum: bool = True  # "lorem ipsum" anywhere: placeholder text
    filter_curly_bracket: bool = True  # "{" anywhere: code or templates in a prose page


class FineWebRules(Section):
    """clean.fineweb: datatrove's FineWebQualityFilter; the defaults are FineWeb's."""

    domains: list[str] = names_field("domain", ["web", "prose"])
    line_punct_thr: float = Field(default=0.12, ge=0.0, le=1.0)  # min fraction of lines ending in . ! ? etc.
    short_line_thr: float = Field(default=0.67, ge=0.0, le=1.0)  # max fraction of lines of <= short_line_length
    short_line_length: int = Field(default=30, ge=0)
    char_duplicates_ratio: float = Field(default=0.01, ge=0.0, le=1.0)  # max fraction of chars in repeated lines
    new_line_ratio: float = Field(default=0.3, ge=0.0)  # max newlines per word (lists, tables)


class C4Judge(C4QualityFilter):
    """C4QualityFilter's verdict on a document, without its rewrite of the text (see the module)."""

    def __init__(self, rules: C4Rules, exclusion_writer=None):
        super().__init__(
            exclusion_writer,
            filter_no_terminal_punct=rules.filter_no_terminal_punct,
            min_num_sentences=rules.min_num_sentences,
            min_words_per_line=rules.min_words_per_line,
            filter_lorem_ipsum=rules.filter_lorem_ipsum,
            filter_curly_bracket=rules.filter_curly_bracket,
        )

    def filter(self, doc: DtDocument) -> bool | tuple[bool, str]:
        text = doc.text
        try:
            return super().filter(doc)
        finally:
            doc.text = text


def fineweb_filter(rules: FineWebRules) -> FineWebQualityFilter:
    return FineWebQualityFilter(
        line_punct_thr=rules.line_punct_thr,
        short_line_thr=rules.short_line_thr,
        short_line_length=rules.short_line_length,
        char_duplicates_ratio=rules.char_duplicates_ratio,
        new_line_ratio=rules.new_line_ratio,
    )
