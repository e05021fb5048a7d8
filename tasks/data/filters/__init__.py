"""The clean stage's own datatrove filters: code rules, PII redaction and user-supplied blocklists.

The prose rules (Gopher, C4, FineWeb) and language ID are datatrove's and are wired in
`tasks/data/clean.py`; what datatrove does not ship, or ships only with a download at run time,
lives here, one module per rule set, each a `BaseFilter` or `BaseFormatter` that pickles.
"""
