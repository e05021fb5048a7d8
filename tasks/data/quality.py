"""The clean stage's model-based quality filter: a supervised fastText classifier, applied per document.

The shipped model (`data/models/quality_classifier.ftz`, built by
`scripts/train_quality_classifier.py`) has two labels, `hq` and `lq`; a document is kept when
its P(hq) reaches the configured threshold. A model trained from the user's references
(`tasks/data/quality_training.py`) replaces it when `clean.quality_training` is set, trained
reproducibly. The shipped one was trained with fastText's 10 Hogwild threads, which is not
reproducible, so it is trained once and committed; applying either is deterministic, and the stage
key hashes the model file's bytes (`tasks/graph.py`).
"""

from __future__ import annotations

from pathlib import Path

from datatrove.data import Document as DtDocument
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.writers import JsonlWriter

from kiln.tasks.bundled import locate
from kiln.tasks.errors import ConfigError

SHIPPED_MODEL = "data/models/quality_classifier.ftz"
HQ_LABEL = "__label__hq"
SCORE_KEY = "quality_score"  # P(hq), written into each judged document's metadata


def fasttext_text(text: str) -> str:
    """fastText reads one line: newlines become spaces (as in training)."""
    return " ".join(text.split())


def check_quality_model(path: str) -> Path:
    """The model at `path` (clean.quality_model; the shipped one from any folder: `tasks.bundled`), or a
    ConfigError saying what is wrong."""
    import fasttext

    model_path = locate(path)
    if not model_path.is_file():
        raise ConfigError(
            f"clean.quality_model: {model_path} does not exist; point it at a fastText model "
            f"(the shipped one is {SHIPPED_MODEL}, rebuilt by scripts/train_quality_classifier.py) "
            "or set clean.quality_model=null to skip the classifier"
        )
    try:
        labels = fasttext.load_model(str(model_path)).get_labels()
    except ValueError as error:
        raise ConfigError(f"clean.quality_model: {model_path} is not a fastText model ({error})") from error
    if HQ_LABEL not in labels:
        raise ConfigError(
            f"clean.quality_model: {model_path} has labels {labels}, not {HQ_LABEL!r}; "
            "train it with scripts/train_quality_classifier.py"
        )
    return model_path


class QualityClassifierFilter(BaseFilter):
    """Records every document's P(hq) as `quality_score`; keeps those of `domains` whose score
    reaches `threshold` (documents of other domains are scored, never removed).

    Not datatrove's FastTextClassifierFilter: that one passes a bare string to `predict`, which
    numpy 2 rejects, and gives no reason for what it drops.
    """

    name = "🤖 fastText quality"

    def __init__(self, model_path: str, threshold: float, exclusion_writer: JsonlWriter | None = None,
                 domains: list[str] | None = None):
        super().__init__(exclusion_writer)
        self.model_path = model_path
        self.threshold = threshold
        self.domains = None if domains is None else frozenset(domains)  # None: judge every document
        self._model = None  # loaded in the worker: fastText models do not pickle

    def score(self, text: str) -> float:
        if self._model is None:
            import fasttext

            self._model = fasttext.load_model(self.model_path)
        labels, scores = self._model.predict([fasttext_text(text)], k=-1)
        return rounded_score(float(dict(zip(labels[0], scores[0]))[HQ_LABEL]))

    def filter(self, doc: DtDocument) -> bool | tuple[bool, str]:
        doc.metadata[SCORE_KEY] = self.score(doc.text)
        if self.domains is not None and doc.metadata["domain"] not in self.domains:
            return True  # scored for later stages (annealing), judged only in the model's domains
        return doc.metadata[SCORE_KEY] >= self.threshold or (False, "low_quality")


def rounded_score(probability: float) -> float:
    """A score as recorded in metadata, exactly the one a threshold judges: 4 significant digits, so
    that the many small probabilities of a reference-trained model keep their order (a top-fraction
    cut needs it) where 4 decimals would make them all 0.0."""
    return float(f"{probability:.4g}")
