"""Every stage key of the bundled configs, pinned: a refactor that moves code between layers (issue
30's one direction) must leave them byte-identical, since a key names a stage's output in every
existing store. A change that means to move a key updates tests/fixtures/golden_keys.json in the same
commit and says in its message which keys moved and why (tests/test_graph.py states which config
fields move which keys)."""

import json
from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.graph import stage_keys

GOLDEN = Path(__file__).parent / "fixtures" / "golden_keys.json"


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_the_bundled_configs_keys_are_the_pinned_ones(name):
    pinned = json.loads(GOLDEN.read_text())[name]
    keys = stage_keys(load_config(f"configs/{name}.yaml"))
    moved = {stage: (pinned.get(stage), key) for stage, key in keys.items() if pinned.get(stage) != key}
    assert not moved, f"configs/{name}.yaml: stage keys moved (pinned, now): {moved}"
