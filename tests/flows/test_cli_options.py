"""One set of options (issue 37): in every command that reads a Kiln config, `--work-dir DIR` is the
override `work_dir=DIR`, wherever it stands on the command line; the commands that read no config say so."""

from __future__ import annotations

import argparse

from kiln.flows.cli import NO_CONFIG_COMMANDS, _load, _parse_intermixed, build_parser

FIRST = {"stage": "collect", "lineage": "collect", "inspect": "clean", "dedup-batch": "batch.jsonl", "batch": "june",
         "export": "anneal", "slurm": "status"}  # the commands whose first argument is no config
REQUIRED = {"export": ["--out", "hf"], "adjust": ["--from-step", "10"], "batch": ["--name", "june", "--domain", "web"]}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _work_dir(argv: list[str]) -> str:
    """The work_dir the command's config gets from this command line."""
    ns = _parse_intermixed(build_parser(), argv)
    if hasattr(ns, "args"):
        return _load(ns)[0].work_dir
    (given,) = [o.partition("=")[2] for o in ns.overrides if o.startswith("work_dir=")]
    return given


def test_work_dir_means_the_same_in_every_command(tmp_path):
    commands = _commands()
    assert set(NO_CONFIG_COMMANDS) - {"eval"} <= set(commands)  # eval's command line is lm-eval's own
    checked = []
    for name in sorted(set(commands) - set(NO_CONFIG_COMMANDS)):
        first = ([FIRST[name]] if name in FIRST else []) + REQUIRED.get(name, [])
        d = str(tmp_path / name)
        forms = [[name, *first, "--work-dir", d], [name, *first, f"work_dir={d}"],
                 [name, "--work-dir", d, *first, "train.run.steps=3"]]
        assert {_work_dir(argv) for argv in forms} == {d}, name
        checked.append(name)
    assert {"run", "status", "plan", "slurm", "deploy", "serve", "up", "down"} <= set(checked)
