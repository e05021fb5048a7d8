"""Which config changes move which stage keys: outputs are addressed by what made them."""

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError
from kiln.tasks.graph import downstream_of, stage_keys
from kiln.tasks.stages import REGISTRY

STAGE_NAMES = REGISTRY.pipeline()


@pytest.fixture(scope="module")
def base_keys():
    return stage_keys(load_config("configs/default.yaml"))


def changed(base_keys, *overrides):
    keys = stage_keys(load_config("configs/default.yaml", list(overrides)))
    return [s for s in STAGE_NAMES if keys[s] != base_keys[s]]


def test_keys_are_deterministic(base_keys):
    assert stage_keys(load_config("configs/default.yaml")) == base_keys


def test_minhash_threshold_moves_dedup_and_everything_downstream(base_keys):
    assert changed(base_keys, "dedup.threshold=0.75") == downstream_of("dedup")
    assert downstream_of("dedup")[:3] == ["dedup", "decontaminate", "tokenize"]
    assert "collect" not in downstream_of("dedup") and "clean" not in downstream_of("dedup")


@pytest.mark.parametrize("override", [
    "clean.num_workers=7", "dedup.num_workers=3", "sweep.max_parallel=1", "tracking.uri=sqlite:///elsewhere.db",
    "log_level=DEBUG", "work_dir=/tmp/other", "train.run.checkpoint_every=7", "train.run.log_every=1",
    "evaluate.batch_size=2", "cluster.launcher=torchrun", "store.root=/tmp/store", "orchestration.retries=4",
    # the layout and the micro-batch are runtime: the global batch is the science
    "train.parallel.dp=2", "train.parallel=auto", "train.run.grad_accum=2", "cluster.launcher=slurm",
])
def test_runtime_settings_move_no_key(base_keys, override):
    assert changed(base_keys, override) == []


@pytest.mark.parametrize("override,first", [
    ("clean.language_threshold=0.5", "clean"),
    ("tokenize.vocab_size=1024", "tokenize"),
    ("dedup.engine=datatrove", "dedup"),
    ("decontaminate.eval_boilerplate_min_docs=5", "decontaminate"),
    ("sweep.lr=0.002", "sweep"),
    ("train.run.steps=301", "mix"),
    ("train.optim.weight_decay=0.0", "train"),
    ("train.run.batch_size=16", "mix"),
    ("train.lr=0.001", "train"),
    ("anneal.steps=10", "anneal"),
    ("anneal.from_step=1000", "anneal"),
    ("anneal_ablation.steps=5", "anneal-ablation"),
    ("sweep.model.norm=layernorm", "sweep"),  # a model option moves the stages that train with it
    ("validate.model.position=alibi", "fit"),  # the fit plans the validation run at that model
    ("train.optim.mtp_weight=0.1", "train"),
    ("evaluate.limit=5", "anneal-ablation"),  # the ablation scores its branches with the evaluate suite
])
def test_identity_settings_move_their_stage_and_downstream(base_keys, override, first):
    moved = changed(base_keys, override)
    assert moved[0] == first
    assert set(moved) <= set(downstream_of(first))


@pytest.mark.parametrize("override", [
    "sweep.model.position=rope", "sweep.model.norm_placement=pre", "validate.model.mlp=swiglu",
    "sweep.model.mtp_heads=0", "train.optim.mtp_weight=0.3", "sweep.model.sliding_window=null",
])
def test_model_options_at_their_defaults_move_no_key(base_keys, override):
    """Options added after keys were published enter the identity only when set otherwise: the
    bundled run's keys (and its checkpoints) are the ones it had before they existed."""
    assert changed(base_keys, override) == []


def test_the_data_schedule_moves_train_and_what_follows(base_keys):
    """The default config trains two data phases; without them (the mix stage's mixture throughout) the
    train key is the one it had before schedules existed, and so are the keys of the stages before it."""
    moved = changed(base_keys, "train.phases=[]")
    assert moved[0] == "train" and set(moved) <= set(downstream_of("train"))


def test_eval_suite_moves_decontamination(base_keys, tmp_path):
    other = tmp_path / "eval.jsonl"
    other.write_text('{"text": "a different benchmark"}\n')
    moved = changed(base_keys, f"evaluate.eval_files=[{other}]")
    assert moved[0] == "decontaminate" and "evaluate" in moved


def test_source_content_moves_collect(base_keys, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "one text"}\n')
    # records may also be of the other domains the default config's filters and mixtures name
    override = (f"collect.sources=[{{name: s, path: {src}, format: jsonl, domain: prose, licence: MIT, "
                "domain_field: domain, domains: [web, code, multilingual]}]")
    overrides = [override, "clean.quality_training.positive_sources=[]"]  # the source it names is gone
    first = stage_keys(load_config("configs/default.yaml", overrides))
    (src / "a.jsonl").write_text('{"text": "another text"}\n')
    second = stage_keys(load_config("configs/default.yaml", overrides))
    assert first["collect"] != second["collect"] and first["clean"] != second["clean"]


@pytest.mark.parametrize("override,fix", [
    ("train.optim.lr=0.01", "the learning rate is train.lr"),
    ("sweep.optim.lr=0.01", "the sweep's learning rate is sweep.lr"),
])
def test_a_learning_rate_that_would_be_ignored_is_refused(override, fix):
    with pytest.raises(ConfigError, match=fix):
        load_config("configs/default.yaml", [override])


def test_keys_hash_no_learning_rate_that_is_not_used():
    cfg = load_config("configs/default.yaml")
    assert "lr" not in cfg.train.identity()["optim"] and "lr" not in cfg.sweep.identity()["optim"]
