"""Licence strings as real data writes them, normalised to SPDX expressions and judged against an allowlist.

Records carry free-form licence strings: Debian `copyright` files write `GPL-2+`, `Expat` or
`GPL-2+ with OpenSSL exception`; some add a comment (`BSD-4-Clause-UC (fortune-mod; collected
quotations)`). `license-expression` parses SPDX expressions offline with its bundled SPDX index;
this module first rewrites Debian's short names into SPDX ids, then parses, then judges the
expression: an OR is allowed if any branch is (a user may pick that branch), an AND only if every
part is, and `X WITH exception` as `X` (an exception only adds permissions). Keys are compared
exactly after normalisation: `GPL-2.0-only` allowed does not allow `GPL-2.0-or-later`.

Package indexes write licence *names*: PyPI's trove classifiers (`License :: OSI Approved :: MIT
License`) and the `License` field (`Apache License, Version 2.0`, `PSFL`). A whole string that is
one of the common names maps to its SPDX id (`_INDEX_NAMES`), whatever its case, commas, British
spelling (`MIT Licence`), leading `The` or the classifier prefix (`The MIT License (MIT)`). PyPI's
`Apache Software License` classifier maps to Apache-2.0 (see `_INDEX_NAMES`); a name that does not
say which licence it is (`Other/Proprietary License`, `Freely Distributable`) stays unknown.

A string that does not parse, or names a licence the SPDX index does not know (and is no
`LicenseRef-`), is *unknown*: the collect stage removes such records with the reason and lists
the string in its compliance report. Nothing here raises on input data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Literal

from license_expression import AND, OR, LicenseSymbol, LicenseWithExceptionSymbol, Licensing, get_spdx_licensing

Status = Literal["allowed", "not_allowed", "unknown"]

# Longer strings are not licence expressions (a pasted licence text, a corrupt field): unknown.
MAX_LICENCE_CHARS = 500
# Debian short names (DEP-5) whose SPDX id is not their name with `.0` added to the version.
_DEBIAN_ALIASES = {
    "expat": "MIT",
    "public-domain": "LicenseRef-public-domain",
    "public_domain": "LicenseRef-public-domain",
    "psf": "PSF-2.0",
    "python": "PSF-2.0",
    "perl": "(Artistic-1.0-Perl OR GPL-1.0-or-later)",  # DEP-5 defines "Perl" as this choice
}
# Licence names as package indexes write them (trove classifiers without their `License :: ... ::` prefix,
# PyPI's License field), lowercased, commas dropped, `licence` spelt `license`, a leading `the` dropped,
# spaces collapsed (`_index_key`) -> SPDX.
_INDEX_NAMES = {
    **dict.fromkeys(["mit license", "mit license (mit)", "mit (mit license)", "expat license",
                     "mit license (expat)", "mit/expat license"], "MIT"),
    "mit no attribution license (mit-0)": "MIT-0",
    **dict.fromkeys(["apache license version 2.0", "apache license 2.0", "apache license v2.0", "apache license v2",
                     "apache 2.0", "apache 2", "apache2", "apache-2", "apache software license 2.0",
                     "apache software license version 2.0", "apache license (2.0)", "asl 2.0", "al2",
                     "apache license version 2.0 (apache-2.0)", "apache software license (apache-2.0)",
                     "apache software license (apache license 2.0)"], "Apache-2.0"),
    # PyPI's only Apache classifier, `License :: OSI Approved :: Apache Software License`, names no version.
    # It is read as Apache-2.0: the ASF has published no other licence since 2004 (1.0 and 1.1 are retired,
    # and the classifier list never had a versioned Apache entry to choose instead), so the packages that
    # carry it are, with rare exceptions, Apache-2.0 ones, and leaving it unknown removed every one of them.
    # licence_as_written keeps the classifier, so a compliance review can still see what the record said.
    "apache software license": "Apache-2.0",
    # The classifier does not say which BSD licence; BSD-3-Clause's terms include BSD-2-Clause's, so a
    # use that complies with it complies with either. licence_as_written keeps what the record said.
    **dict.fromkeys(["bsd license", "bsd", "new bsd license", "modified bsd license", "revised bsd license",
                     "3-clause bsd license", "bsd 3-clause license", "bsd 3-clause", "bsd-3",
                     "bsd 3-clause \"new\" or \"revised\" license"], "BSD-3-Clause"),
    **dict.fromkeys(["simplified bsd license", "2-clause bsd license", "bsd 2-clause license", "bsd 2-clause",
                     "bsd-2", "freebsd license", "bsd 2-clause \"simplified\" license"], "BSD-2-Clause"),
    **dict.fromkeys(["psfl", "psf license", "psf", "python software foundation license",
                     "python software foundation license version 2", "psf-2"], "PSF-2.0"),
    **dict.fromkeys(["isc license (iscl)", "isc license", "iscl"], "ISC"),
    **dict.fromkeys(["mozilla public license 2.0 (mpl 2.0)", "mozilla public license 2.0", "mpl 2.0", "mpl-2",
                     "mplv2"], "MPL-2.0"),
    **dict.fromkeys(["gnu general public license v2 (gplv2)", "gplv2", "gpl v2", "gpl version 2"], "GPL-2.0-only"),
    **dict.fromkeys(["gnu general public license v2 or later (gplv2+)", "gplv2+", "gpl v2+", "gplv2 or later"],
                    "GPL-2.0-or-later"),
    **dict.fromkeys(["gnu general public license v3 (gplv3)", "gplv3", "gpl v3", "gpl version 3"], "GPL-3.0-only"),
    **dict.fromkeys(["gnu general public license v3 or later (gplv3+)", "gplv3+", "gpl v3+", "gplv3 or later"],
                    "GPL-3.0-or-later"),
    **dict.fromkeys(["gnu lesser general public license v2 (lgplv2)", "lgplv2"], "LGPL-2.0-only"),
    **dict.fromkeys(["gnu lesser general public license v2 or later (lgplv2+)", "lgplv2+"], "LGPL-2.0-or-later"),
    **dict.fromkeys(["gnu lesser general public license v3 (lgplv3)", "lgplv3"], "LGPL-3.0-only"),
    **dict.fromkeys(["gnu lesser general public license v3 or later (lgplv3+)", "lgplv3+"], "LGPL-3.0-or-later"),
    **dict.fromkeys(["gnu affero general public license v3", "agplv3"], "AGPL-3.0-only"),
    **dict.fromkeys(["gnu affero general public license v3 or later (agplv3+)", "agplv3+"], "AGPL-3.0-or-later"),
    **dict.fromkeys(["unlicense (unlicense)", "unlicense"], "Unlicense"),
    **dict.fromkeys(["zlib/libpng license", "zlib license"], "Zlib"),
    **dict.fromkeys(["eclipse public license 2.0 (epl-2.0)", "eclipse public license 2.0"], "EPL-2.0"),
    **dict.fromkeys(["eclipse public license 1.0 (epl-1.0)", "eclipse public license 1.0"], "EPL-1.0"),
    **dict.fromkeys(["boost software license 1.0 (bsl-1.0)", "boost software license 1.0"], "BSL-1.0"),
    **dict.fromkeys(["historical permission notice and disclaimer (hpnd)"], "HPND"),
    **dict.fromkeys(["cc0 1.0 universal (cc0 1.0) public domain dedication", "cc0 1.0 universal", "cc0"], "CC0-1.0"),
    **dict.fromkeys(["public domain", "public domain dedication"], "LicenseRef-public-domain"),
    **dict.fromkeys(["creative commons attribution 4.0 international", "cc by 4.0", "cc-by 4.0"], "CC-BY-4.0"),
    **dict.fromkeys(["creative commons attribution-sharealike 4.0 international", "cc by-sa 4.0", "cc-by-sa 4.0"],
                    "CC-BY-SA-4.0"),
    **dict.fromkeys(["creative commons attribution 3.0 unported", "cc by 3.0", "cc-by 3.0"], "CC-BY-3.0"),
    **dict.fromkeys(["creative commons attribution-sharealike 3.0 unported", "cc by-sa 3.0", "cc-by-sa 3.0"],
                    "CC-BY-SA-3.0"),
}
_CLASSIFIER_PREFIX = re.compile(r"^\s*license\s*::\s*(?:osi approved\s*::\s*)?", re.IGNORECASE)
_OPERATORS = {"and", "or", "with"}
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-+_:]*")
_DEBIAN_VERSION = re.compile(r"(?P<name>.+?)-(?P<version>\d+(?:\.\d+)*)(?P<plus>\+?)")
# DEP-5 writes exceptions as a phrase: "GPL-2+ with OpenSSL exception".
_DEBIAN_EXCEPTION = re.compile(r"\bwith\s+([A-Za-z0-9.\-+]+)(?<!-exception)\s+exception\b", re.IGNORECASE)
_INNERMOST_GROUP = re.compile(r"\(([^()]*)\)")


@dataclass(frozen=True)
class LicenceVerdict:
    """What one licence string means: its SPDX expression (None if it does not parse) and status."""

    raw: str
    spdx: str | None
    status: Status
    unknown_keys: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The name the stage reports it under: the SPDX expression, else the string as written."""
        return self.spdx or self.raw


@cache
def _licensing() -> Licensing:
    return get_spdx_licensing()


@cache
def _known_names() -> frozenset[str]:
    """Every SPDX id and alias the index knows (`GPL-2.0` is an alias of `GPL-2.0-only`), lowercased."""
    names = set()
    for symbol in _licensing().known_symbols.values():
        names.add(symbol.key.lower())
        names.update(alias.lower() for alias in symbol.aliases)
    return frozenset(names)


def _is_known(key: str) -> bool:
    return key.lower() in _known_names() or key.startswith("LicenseRef-")


def _spdx_token(token: str) -> str:
    """One word of a licence string as SPDX would spell it (operators and unknown words unchanged)."""
    lower = token.lower()
    if lower in _OPERATORS or _is_known(token):
        return token
    if lower in _DEBIAN_ALIASES:
        return _DEBIAN_ALIASES[lower]
    match = _DEBIAN_VERSION.fullmatch(token)
    if match:  # Debian drops a trailing ".0": GPL-2+ is SPDX's GPL-2.0+ (= GPL-2.0-or-later)
        name, version, plus = match["name"], match["version"], match["plus"]
        for candidate in (f"{name}-{version}", f"{name}-{version}.0"):
            if _is_known(candidate):
                return candidate + plus
    return token


def _debian_to_spdx(text: str) -> str:
    text = _DEBIAN_EXCEPTION.sub(lambda m: f"WITH {m[1]}-exception", text)
    return _TOKEN.sub(lambda m: _spdx_token(m[0]), text)


def _try_parse(text: str):
    """The parsed expression, or None when `text` is no expression.

    Any exception means "does not parse": besides its own `ExpressionError`, license-expression
    (through boolean.py) raises IndexError, TypeError and others on malformed strings such as `()`.
    Only a pure parse of one string sits inside this `try`, so no other failure can hide here.
    """
    try:
        return _licensing().parse(text)
    except Exception:  # noqa: BLE001 — see the docstring
        return None


def _parse(text: str):
    """The parsed expression, or None. A parenthesised comment that is no expression of known
    licences (`(fortune-mod; collected quotations)`) is dropped when the whole does not parse."""
    expression = _try_parse(text)
    if expression is not None:
        return expression

    def drop_comment(match: re.Match[str]) -> str:
        inner = _try_parse(match[1])
        if inner is None or _licensing().unknown_license_keys(inner):
            return " "
        return f"[{match[1]}]"  # a real group: kept, bracketed so the loop below does not see it again

    stripped, previous = text, None
    while stripped != previous:
        previous, stripped = stripped, _INNERMOST_GROUP.sub(drop_comment, stripped)
    return _try_parse(stripped.replace("[", "(").replace("]", ")"))


def _status(node, allowed: frozenset[str]) -> Status:
    if isinstance(node, LicenseWithExceptionSymbol):
        return _status(node.license_symbol, allowed)
    if isinstance(node, LicenseSymbol):
        if node.is_exception or not _is_known(node.key):
            return "unknown"
        return "allowed" if node.key.lower() in allowed else "not_allowed"
    statuses = [_status(arg, allowed) for arg in node.args]
    if isinstance(node, OR):
        winner = ("allowed", "unknown", "not_allowed")  # any allowed branch will do
    else:
        assert isinstance(node, AND), f"unexpected licence expression node {node!r}"
        winner = ("not_allowed", "unknown", "allowed")  # one forbidden part forbids the whole
    return next(status for status in winner if status in statuses)


_BRITISH = re.compile(r"\blicence\b")


def _index_key(text: str) -> str:
    """`text` as `_INDEX_NAMES` spells it: `The MIT Licence (MIT)` -> `mit license (mit)`."""
    key = " ".join(_BRITISH.sub("license", _CLASSIFIER_PREFIX.sub("", text).lower()).replace(",", " ").split())
    return key.removeprefix("the ")


def _expression(raw: str):
    if len(raw) > MAX_LICENCE_CHARS or not raw.strip():
        return None
    return _parse(_INDEX_NAMES.get(_index_key(raw)) or _debian_to_spdx(raw))


def normalise(raw: str) -> str | None:
    """`raw` as a normalised SPDX expression (`GPL-2+` → `GPL-2.0-or-later`), or None if it does not parse."""
    expression = _expression(raw)
    return None if expression is None else str(expression)


class LicencePolicy:
    """Judges licence strings against an allowlist of licence ids (each normalised the same way)."""

    def __init__(self, allowed: list[str]):
        keys = []
        for i, entry in enumerate(allowed):
            parsed = _expression(entry)
            if not isinstance(parsed, LicenseSymbol) or parsed.is_exception or not _is_known(parsed.key):
                raise ValueError(
                    f"allowed licence [{i}] {entry!r} is not one SPDX licence id: use an id from "
                    "https://spdx.org/licenses/ (e.g. GPL-2.0-or-later) or a LicenseRef-... name"
                )
            keys.append(parsed.key)
        self.allowed = tuple(sorted(set(keys)))
        self._allowed_lower = frozenset(key.lower() for key in keys)
        self._verdicts: dict[str, LicenceVerdict] = {}

    def judge(self, raw: str) -> LicenceVerdict:
        verdict = self._verdicts.get(raw)
        if verdict is None:
            verdict = self._verdicts[raw] = self._judge(raw)
        return verdict

    def _judge(self, raw: str) -> LicenceVerdict:
        expression = _expression(raw)
        if expression is None:
            return LicenceVerdict(raw, None, "unknown")
        unknown = tuple(sorted({s.key for s in _licensing().license_symbols(expression) if not _is_known(s.key)}))
        return LicenceVerdict(raw, str(expression), _status(expression, self._allowed_lower), unknown)
