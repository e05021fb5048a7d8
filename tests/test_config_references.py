"""A config of one's own: `!replace` drops inherited mapping entries, and every domain and source a config
names is checked against collect's sources when it loads, naming the file and key that set it."""

import re
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "configs/default.yaml"
SOURCES = """\
collect:
  sources:
    - {name: articles, path: data, format: jsonl, domain: news, domain_field: domain, domains: [legal]}
    - {name: posts, path: data, format: jsonl, domain: forum}
"""
# Everything in the default config that names a domain or a source, restated for news/legal/forum.
OWN = SOURCES + """\
clean:
  language_domains: [news, legal, forum]
  quality_domains: [news, legal]
  quality_model_domains: [news, legal]
  pii_domains: [news, legal, forum]
  c4: {domains: [news]}
  fineweb: {domains: [news]}
  code: {domains: []}
  quality_training: {positive_sources: [articles], negative_domains: [forum]}
sweep:
  mixtures: !replace
    uniform: {news: 1, legal: 1, forum: 1}
anneal:
  mixture: !replace {news: 0.5, forum: 0.25, best: {quality_top: 0.2, weight: 0.25, domains: [news, legal]}}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_replace_takes_the_place_of_an_inherited_mapping(tmp_path):
    write(tmp_path / "base.yaml", "sweep: {mixtures: {uniform: {a: 1, b: 1}, heavy: {a: 3, b: 1}}}\n"
                                  "anneal: {mixture: {a: 0.5, b: 0.5}}\n")
    merged = write(tmp_path / "merged.yaml", "extends: base.yaml\nsweep: {mixtures: {mine: {a: 1}}}\n")
    assert list(load_config(merged).sweep.mixtures) == ["uniform", "heavy", "mine"]  # mappings merge key by key
    child = write(tmp_path / "child.yaml", "extends: base.yaml\nsweep: {mixtures: !replace {mine: {a: 1}}}\n"
                                           "anneal: !replace {mixture: !replace {a: 1}}\n")
    cfg = load_config(child)
    assert cfg.sweep.mixtures == {"mine": {"a": 1.0}} and cfg.anneal.mixture == {"a": 1.0}
    grandchild = write(tmp_path / "grandchild.yaml", "extends: child.yaml\nsweep: {mixtures: {more: {b: 1}}}\n")
    assert list(load_config(grandchild).sweep.mixtures) == ["mine", "more"]  # what replaced, merges in turn


def test_replace_tags_only_mappings_and_lists(tmp_path):
    lists = write(tmp_path / "lists.yaml", "extends: " + str(DEFAULT) + "\nclean: {languages: !replace [en]}\n")
    assert load_config(lists).clean.languages == ["en"]
    scalar = write(tmp_path / "scalar.yaml", "dedup:\n  threshold: !replace 0.5\n")
    with pytest.raises(ConfigError, match=r"scalar.yaml:2: not valid YAML \(!replace tags a mapping or a list"):
        load_config(scalar)


def test_inherited_domains_the_sources_lack_are_errors_naming_file_and_key(tmp_path):
    child = write(tmp_path / "mine.yaml", f"extends: {DEFAULT}\n" + SOURCES
                  + "sweep: {mixtures: {mine: {news: 1, legal: 2}}}\n")  # merged: default's mixtures stay
    with pytest.raises(ConfigError) as error:
        load_config(child)
    message = str(error.value)
    assert "its domains: ['news', 'legal', 'forum']; its sources: ['articles', 'posts']" in message
    assert f"{DEFAULT}: sweep.mixtures.uniform: domains ['web', 'code', 'prose', 'multilingual'] are not in " \
           "collect.sources" in message
    assert f"{DEFAULT}: anneal.mixture: domains ['prose', 'web', 'code', 'multilingual']" in message
    assert f"{DEFAULT}: anneal.mixture.best.domains: domains ['web', 'prose']" in message
    assert f"{DEFAULT}: clean.c4.domains: domains ['web', 'prose']" in message
    assert "defaults: clean.language_domains: domains ['web', 'prose', 'multilingual']" in message  # never written
    assert f"{DEFAULT}: clean.quality_training.positive_sources: sources ['web-maint-guide-en'] are not in " \
           "collect.sources" in message
    assert "sweep.mixtures.mine" not in message and "`!replace`" in message


def test_a_config_naming_only_its_own_domains_and_sources_loads(tmp_path):
    cfg = load_config(write(tmp_path / "mine.yaml", f"extends: {DEFAULT}\n" + OWN))
    assert cfg.collect.domains() == ["news", "legal", "forum"] and list(cfg.sweep.mixtures) == ["uniform"]
    assert set(cfg.anneal.mixture) == {"news", "forum", "best"}


@pytest.mark.parametrize(("override", "origin", "key", "names"), [
    ("clean.quality_training.positive_sources=[articles,papers]", "command line", "clean.quality_training.positive_sources",
     "sources ['papers']"),
    ("fit.mixture_target=web", "command line", "fit.mixture_target", "domains ['web']"),
    ("anneal_ablation.candidates={a: {news: 1, sport: 1}}", "command line", "anneal_ablation.candidates.a",
     "domains ['sport']"),
    ("clean.blocklist_domains=[forum,blog]", "command line", "clean.blocklist_domains", "domains ['blog']"),
])
def test_every_name_is_checked(tmp_path, override, origin, key, names):
    mine = write(tmp_path / "mine.yaml", f"extends: {DEFAULT}\n" + OWN)
    with pytest.raises(ConfigError, match=rf"{origin} \(.*\): {key}: {re.escape(names)} are not in collect.sources"):
        load_config(mine, [override])


def test_a_config_without_sources_names_what_it_likes():
    assert load_config(None, ["sweep.mixtures={a: {x: 1}}"]).sweep.mixtures == {"a": {"x": 1.0}}

