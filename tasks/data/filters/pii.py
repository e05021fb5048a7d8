"""PII redaction: emails, public IP addresses, phone numbers and payment-card numbers → placeholders.

Emails and IPs use datatrove's patterns (`PIIFormatter`). Phone numbers and cards are Kiln's,
written to miss rather than to mangle technical text, which is dense with numbers:
- a phone number is either international (`+`, country code, 10-15 digits in all, in groups) or
  North American with separators (`(555) 123-4567`, `555-123-4567`, `555.123.4567`); bare digit
  runs, dates (`2024-01-15`), versions and section numbers do not match, and neither do national
  formats without a `+` outside North America (`020 7946 0958`): too close to other numbers;
- a card number is 13-19 digits, starting 2-6 (the card networks' ranges), bare or in groups
  of 4 (Amex's 4-6-5 too) separated by single spaces or dashes, and it must pass the Luhn check:
  one random digit string in ten does, so the check, not the shape, is what makes it a card.
Each kind has exactly one placeholder, so the output does not depend on how the documents were
sharded, and a placeholder found in the text is never counted (the email one matches the email
pattern; the others match no pattern). Replacements are counted per
document in `PII_METADATA` and per kind in the stage stats.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from datatrove.pipeline.formatters import PIIFormatter
from datatrove.pipeline.formatters.base import BaseFormatter
from datatrove.utils.typeshelper import StatHints

PIIKind = Literal["email", "ip", "card", "phone"]
PII_KINDS: tuple[PIIKind, ...] = ("email", "ip", "card", "phone")  # the order they are redacted in
PII_METADATA = "kiln_pii_replacements"  # {kind: count} of one document, removed when records are merged


def luhn_valid(number: str) -> bool:
    """The Luhn checksum of the digits in `number` (card numbers carry it in their last digit)."""
    digits = [int(c) for c in number if c.isdigit()]
    total = 0
    for i, digit in enumerate(reversed(digits)):
        if i % 2:
            digit = digit * 2 - 9 if digit > 4 else digit * 2
        total += digit
    return bool(digits) and total % 10 == 0


_NOT_IN_A_NUMBER = r"(?<![\w.+/-])"  # not the tail of a longer number, word, version, path or date
_END = r"(?![\w/]|[.-]\d)"
CARD = re.compile(
    _NOT_IN_A_NUMBER
    + r"(?:[2-6]\d{12,18}"  # bare
    + r"|[2-6]\d{3}(?P<sep>[ -])\d{4}(?:(?P=sep)\d{4}){2}(?:(?P=sep)\d{1,3})?"  # 4-4-4-4, then up to 3
    + r"|3\d{3}(?P<amex>[ -])\d{6}(?P=amex)\d{5})"  # Amex 4-6-5
    + _END
)
PHONE = re.compile(
    _NOT_IN_A_NUMBER
    + r"(?:\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){2,6}"  # +49 30 1234567, +33 1 23 45 67 89
    # North American: area code and exchange start 2-9 (so 100-200-3000 is no number)
    + r"|\([2-9]\d{2}\) ?[2-9]\d{2}[.-]\d{4}|[2-9]\d{2}(?P<sep>[.-])[2-9]\d{2}(?P=sep)\d{4})"
    + _END
)


def _phone_digits_ok(text: str) -> bool:
    digits = sum(c.isdigit() for c in text)
    return 10 <= digits <= 15 if text.startswith("+") else digits == 10  # E.164: at most 15


@dataclass(frozen=True)
class _Kind:
    pattern: re.Pattern[str]
    placeholder: str
    valid: Callable[[str], bool] | None = None


def _kinds() -> dict[str, _Kind]:
    datatrove = PIIFormatter()
    return {
        "email": _Kind(datatrove.emails_replacer.regex, "email@example.com"),
        # 192.0.2.0/24 is for documentation (RFC 5737): not public, so never redacted again.
        "ip": _Kind(datatrove.ip_replacer.regex, "192.0.2.1", datatrove.ip_replacer.validator),
        "card": _Kind(CARD, "XXXX-XXXX-XXXX-XXXX", luhn_valid),
        "phone": _Kind(PHONE, "555-0100", _phone_digits_ok),  # 555-0100..0199: reserved for fiction
    }


_KINDS = _kinds()


def redact(text: str, kinds: list[str]) -> tuple[str, dict[str, int]]:
    """`text` with every PII match of `kinds` replaced by its placeholder, and the count per kind."""
    counts = {}
    for name, kind in _KINDS.items():
        if name not in kinds:
            continue
        count = 0

        def replace(match: re.Match[str], kind: _Kind = kind) -> str:
            nonlocal count
            found = match.group(0)
            if found == kind.placeholder or (kind.valid is not None and not kind.valid(found)):
                return found
            count += 1
            return kind.placeholder

        text = kind.pattern.sub(replace, text)
        counts[name] = count
    return text, counts


class PIIRedactor(BaseFormatter):
    """Redacts `kinds` of PII in documents of `domains`, recording counts in `PII_METADATA`. Documents
    whose metadata holds `skip_key` (the clean stage's removed ones, on their way to its writer) pass
    unchanged."""

    name = "📞 PII"

    def __init__(self, kinds: list[str], domains: list[str], skip_key: str | None = None):
        super().__init__()
        unknown = sorted(set(kinds) - set(PII_KINDS))
        assert not unknown, f"unknown PII kinds {unknown}"  # the config's Literal refuses them first
        self.kinds = list(kinds)
        self.domains = frozenset(domains)
        self.skip_key = skip_key

    def format(self, text: str) -> str:
        return redact(text, self.kinds)[0]

    def run(self, data, rank: int = 0, world_size: int = 1):
        for doc in data:
            if self.skip_key is not None and self.skip_key in doc.metadata:
                yield doc
                continue
            self.stat_update(StatHints.total)
            if doc.metadata["domain"] in self.domains:
                with self.track_time():
                    doc.text, counts = redact(doc.text, self.kinds)
                    doc.metadata[PII_METADATA] = counts
                    for kind, count in counts.items():
                        if count:
                            self.stat_update(kind, value=count)
            yield doc
