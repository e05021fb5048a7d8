"""Kiln's shipped configs (package data `kiln.configs`): the default and tiny runs, model and cluster
presets, examples. Read through `kiln.tasks.bundled`, never by a path next to the code."""
