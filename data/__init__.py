"""Kiln's bundled data (package data `kiln.data`): the sample corpus, the held-out eval sets and the
quality classifier. Read through `kiln.tasks.bundled`."""
