"""A collect source as configured: its `format` (jsonl, txt, html, parquet, warc, code, hf) decides which
other fields it takes; every source has a name, a path, a domain (or a record field naming each
record's), a licence where its files carry none, and a weight. The readers (`readers.py`,
`code_tree.py`) and the collect stage (`collect.py`) read these declarations.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, field_validator, model_validator

from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.data.source_files import is_remote, remote_fingerprint

DEFAULT_GLOBS = {
    "jsonl": ("**/*.jsonl", "**/*.jsonl.gz", "**/*.jsonl.zst"), "txt": ("**/*.txt",), "html": ("**/*.html",),
    "parquet": ("**/*.parquet",), "warc": ("**/*.warc", "**/*.warc.gz"), "code": ("**/*",),
}

# A domain names a folder of token shards and a key of every mixture.
_DOMAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_domain_names(names: list[str]) -> list[str]:
    bad = [name for name in names if not _DOMAIN_NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"domain names {bad} must be letters, digits, '_', '-' or '.', starting with a letter or "
                         "digit (a domain names a folder of token shards)")
    return names


class _Source(Section):
    """What every source has: a name, where it is, its domain, its licence and weight."""

    name: str
    # A file, a folder, a glob (`data/*.jsonl.gz`) or an fsspec URL (`s3://bucket/crawl/`, `file:///abs`).
    path: str
    domain: str  # every document's, or the fallback of a source with a `domain_field`
    # An SPDX expression. None where the records or files carry their own (jsonl, parquet, hf:
    # a "licence" or "license" field; code: SPDX headers or the tree's LICENSE); theirs wins.
    licence: str | None = None
    # The share of this source's documents to keep, sampled by a hash of each id (the same ones on
    # every run): 0.25 keeps about a quarter. Up-weighting a domain is the mixture's job (sweep, mix).
    weight: float = Field(1.0, gt=0.0, le=1.0)
    # fsspec options for the store (endpoint_url, anon, ...); credentials belong in the environment
    # (AWS_ACCESS_KEY_ID, ...), not here: config params are logged. Where the files are is not what they are.
    storage_options: dict[str, Any] = runtime_field({})

    @field_validator("domain")
    @classmethod
    def _domain_is_a_name(cls, domain: str) -> str:
        return _check_domain_names([domain])[0]

    def all_domains(self) -> list[str]:
        """Every domain this source's documents may have."""
        return [self.domain]


class _RecordDomains(_Source):
    """A source of records (jsonl, parquet, datasets) may take each record's domain from one of its fields."""

    # The field (jsonl key, parquet or dataset column) holding each record's domain; records without it
    # (or with null) get `domain`. A value outside `domains` is quarantined as `unknown_domain`.
    domain_field: str | None = None
    # The values domain_field may take, so that every domain a config names is checked when it loads.
    domains: list[str] = []

    @field_validator("domains")
    @classmethod
    def _domains_are_names(cls, domains: list[str]) -> list[str]:
        return _check_domain_names(domains)

    @model_validator(mode="after")
    def _domains_with_their_field(self) -> _RecordDomains:
        if self.domain_field is not None and not self.domains:
            raise ValueError(f"domain_field {self.domain_field!r} needs `domains`: the values it may take (e.g. "
                             "domains: [news, forum]), so that mixtures and filters naming domains are checked "
                             "when the config loads")
        if self.domain_field is None and self.domains:
            raise ValueError("`domains` lists the values of a record field: set domain_field (e.g. domain_field: "
                             "domain) or drop `domains`")
        return self

    def all_domains(self) -> list[str]:
        return list(dict.fromkeys([self.domain, *self.domains]))


class _FileSource(_Source):
    glob: str | None = None  # files of a folder to read (default: every file of the format, recursively)


class JsonlSource(_FileSource, _RecordDomains):
    format: Literal["jsonl"]
    compression: Literal["infer", "none", "gzip", "zstd"] = "infer"  # infer: from .gz / .zst


class TextSource(_FileSource):
    format: Literal["txt"]


class HtmlSource(_FileSource):
    format: Literal["html"]


class ParquetSource(_FileSource, _RecordDomains):
    format: Literal["parquet"]
    text_column: str = "text"
    id_column: str | None = "id"
    columns: list[str] | None = None  # the columns to read (None: all); other columns become metadata


class WarcSource(_FileSource):
    format: Literal["warc"]  # .warc or .warc.gz; response records with HTML payloads become documents


class CodeSource(_FileSource):
    format: Literal["code"]  # a source tree: one document per file (tasks/data/code_tree.py)
    exclude: list[str] = []  # globs of paths in the tree to skip (`docs/**`), removed as `excluded`


class DatasetSource(_RecordDomains):
    """A Hugging Face dataset: a local folder (save_to_disk output, or data files datasets can build)
    or a hub id, loaded by `datasets` itself. Pin `revision` for a hub dataset: its key is its config."""

    format: Literal["hf"]
    config_name: str | None = None  # the dataset's configuration (load_dataset's `name`)
    split: str = "train"
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    revision: str | None = None
    text_column: str = "text"
    id_column: str | None = "id"
    columns: list[str] | None = None


Source = Annotated[
    JsonlSource | TextSource | HtmlSource | ParquetSource | WarcSource | CodeSource | DatasetSource,
    Field(discriminator="format"),
]
_SOURCE = TypeAdapter(Source)
# Formats whose files carry no licence of their own: the source must name one.
NEEDS_SOURCE_LICENCE = ("txt", "html", "warc")


def SourceConfig(**fields: Any) -> Source:  # noqa: N802 — reads as the constructor of a source entry
    """A source entry of the format `fields["format"]` (for code and tests; YAML goes through CollectConfig)."""
    return _SOURCE.validate_python(fields)


def remote_identity(sources: list[Source]) -> dict[str, str]:
    """Each remote source's listing fingerprint, by name (hub datasets are pinned by their revision)."""
    return {s.name: remote_fingerprint(s.path, source_patterns(s), s.storage_options) for s in sources
            if is_remote(s.path) and s.format != "hf"}


def source_patterns(source: Source) -> tuple[str, ...]:
    """The file globs of a source: its own, else every file of its format."""
    glob = getattr(source, "glob", None)
    return (glob,) if glob else DEFAULT_GLOBS.get(source.format, ())
