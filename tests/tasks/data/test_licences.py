"""Licence strings as Debian and real datasets write them → SPDX expressions, judged against an allowlist."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kiln.tasks.data.licences import LicencePolicy, normalise

POLICY = LicencePolicy(["MIT", "Apache-2.0", "GPL-2.0-or-later", "GPL-3.0-or-later", "CC-BY-SA-3.0", "public-domain"])


@pytest.mark.parametrize(
    ("written", "spdx"),
    [
        ("GPL-2+", "GPL-2.0-or-later"),
        ("GPL-2", "GPL-2.0-only"),  # DEP-5: a bare version means that version only
        ("LGPL-2.1+", "LGPL-2.1-or-later"),
        ("Apache-2", "Apache-2.0"),
        ("Expat", "MIT"),
        ("mit", "MIT"),
        ("BSD-3-clause", "BSD-3-Clause"),
        ("public-domain", "LicenseRef-public-domain"),
        ("GPL-2.0+ or CC-BY-SA-3.0", "GPL-2.0-or-later OR CC-BY-SA-3.0"),
        ("GPL-2+ with OpenSSL exception", "GPL-2.0-or-later WITH OpenSSL-exception"),
        ("BSD-4-Clause-UC (fortune-mod; collected quotations)", "BSD-4-Clause-UC"),  # a comment is dropped
        ("(MIT OR GPL-2+) (see debian/copyright)", "MIT OR GPL-2.0-or-later"),  # a real group is kept
        ("LicenseRef-Debian-FAQ-verbatim", "LicenseRef-Debian-FAQ-verbatim"),
        ("", None), ("()", None), ("MIT OR", None), ("GPL-2+ or Artistic, and BSD", None),
    ],
)
def test_licence_strings_normalise_to_spdx(written, spdx):
    assert normalise(written) == spdx


@pytest.mark.parametrize(
    ("written", "spdx"),
    [
        ("MIT License", "MIT"),
        ("License :: OSI Approved :: MIT License", "MIT"),  # a trove classifier, whole
        ("Apache License, Version 2.0", "Apache-2.0"),
        ("Apache License 2.0", "Apache-2.0"),
        ("BSD License", "BSD-3-Clause"),  # the variant unsaid: the one whose terms include the other's
        ("Simplified BSD License", "BSD-2-Clause"),
        ("PSFL", "PSF-2.0"),
        ("Python Software Foundation License", "PSF-2.0"),
        ("ISC License (ISCL)", "ISC"),
        ("Mozilla Public License 2.0 (MPL 2.0)", "MPL-2.0"),
        ("GNU General Public License v2 or later (GPLv2+)", "GPL-2.0-or-later"),
        ("License :: OSI Approved :: GNU Lesser General Public License v3 (LGPLv3)", "LGPL-3.0-only"),
        ("GNU Affero General Public License v3", "AGPL-3.0-only"),
        ("The Unlicense (Unlicense)", "Unlicense"),
        ("zlib/libpng License", "Zlib"),
        ("CC0 1.0 Universal (CC0 1.0) Public Domain Dedication", "CC0-1.0"),
        ("Public Domain", "LicenseRef-public-domain"),
        ("Creative Commons Attribution 4.0 International", "CC-BY-4.0"),
        # spellings real package metadata carries (issue 34): a leading "The", the id repeated in
        # parentheses, British spelling, the Apache classifier without a version
        ("The MIT License (MIT)", "MIT"),
        ("the mit license", "MIT"),
        ("MIT Licence", "MIT"),
        ("The MIT Licence", "MIT"),
        ("License :: OSI Approved :: MIT Licence", "MIT"),
        ("Apache Software License", "Apache-2.0"),
        ("License :: OSI Approved :: Apache Software License", "Apache-2.0"),
        ("Apache Licence, Version 2.0", "Apache-2.0"),
        ("The Apache License, Version 2.0", "Apache-2.0"),
        ("BSD Licence", "BSD-3-Clause"),
        ("GNU General Public Licence v3 (GPLv3)", "GPL-3.0-only"),
        ("The Unlicense (Unlicense)", "Unlicense"),
    ],
)
def test_licence_names_as_package_indexes_write_them_map_to_spdx(written, spdx):
    assert normalise(written) == spdx
    assert POLICY.judge(written).spdx == spdx


@pytest.mark.parametrize("written", ["Other/Proprietary License", "Freely Distributable", "The License", "Apache License"])
def test_licence_names_that_do_not_say_which_licence_stay_unknown(written):
    assert POLICY.judge(written).status == "unknown"  # reported as written, never guessed


@pytest.mark.parametrize(
    ("written", "status"),
    [
        ("GPL-2+", "allowed"),
        ("GPL-2", "not_allowed"),  # only-2.0 is not on the list; or-later is
        ("GPL-2.0+ or CC-BY-SA-3.0", "allowed"),
        ("BSD-4-Clause OR MIT", "allowed"),  # OR: any allowed branch will do
        ("BSD-4-Clause AND MIT", "not_allowed"),  # AND: every part must be allowed
        ("CC-BY-SA-3.0 and GPL-2+", "allowed"),
        ("MIT OR Frobnicate", "allowed"),
        ("MIT AND Frobnicate", "unknown"),  # cannot be judged
        ("BSD-4-Clause AND Frobnicate", "not_allowed"),  # forbidden whatever Frobnicate is
        ("GPL-2+ with OpenSSL exception", "allowed"),  # an exception only adds permissions
        ("BSD-4-Clause-UC (fortune-mod; collected quotations)", "not_allowed"),
        ("Proprietary", "unknown"),
        ("Classpath-exception-2.0", "unknown"),  # an exception is no licence
        ("x" * 10_000, "unknown"),
    ],
)
def test_expressions_are_judged_by_their_operators(written, status):
    assert POLICY.judge(written).status == status


def test_the_allowlist_is_normalised_and_checked():
    assert "LicenseRef-public-domain" in POLICY.allowed and "GPL-2.0-or-later" in POLICY.allowed
    assert LicencePolicy(["GPL-2+"]).allowed == ("GPL-2.0-or-later",)
    for bad in ["MIT OR Apache-2.0", "Frobnicate", "Classpath-exception-2.0", ""]:
        with pytest.raises(ValueError, match=r"\[0\].*is not one SPDX licence id"):
            LicencePolicy([bad])


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=80),
    st.lists(st.sampled_from(["MIT", "GPL-2+", "and", "OR", "with", "(", ")", "exception", ";", ",", "LicenseRef-x",
                              "Classpath-exception-2.0", "+", "Expat", "Perl"]), max_size=12).map(" ".join),
))
@example("0 WITH 0 EXCEPTION EXCEPTION")  # a DEP-5 exception phrase must not be rewritten twice
def test_any_string_gets_a_verdict_never_an_exception(written):
    verdict = POLICY.judge(written)
    assert verdict.status in ("allowed", "not_allowed", "unknown")
    if verdict.spdx is not None:  # normalising is idempotent: a normalised licence reads as itself
        assert normalise(verdict.spdx) == verdict.spdx
