"""KilnLM's arithmetic against log-probs computed by hand from the same model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.tasks.evals.adapter import KilnLM

SENTENCES = [
    "The cat sat on the mat and looked at the door.",
    "A dog sat by the door and waited for the rain to stop.",
    "The rain fell on the roof of the old house all night.",
    "Old houses creak when the wind blows through the trees.",
    "She opened the door and the cat ran out into the rain.",
]
EOS = "<|endoftext|>"


class TinyLM(torch.nn.Module):
    """Causal toy LM: a bigram table plus `context_weight` x a running mean of past embeddings.

    With context_weight=0 each token's log-prob depends only on the token before it, which
    makes "every token scored exactly once, with the right predecessor" checkable by hand.
    """

    def __init__(self, vocab_size: int, context_weight: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        gen = torch.Generator().manual_seed(seed)
        self.bigram = torch.nn.Parameter(torch.randn(vocab_size, vocab_size, generator=gen))
        self.emb = torch.nn.Parameter(torch.randn(vocab_size, 8, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(8, vocab_size, generator=gen))
        self.context_weight = context_weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, idx.shape[1] + 1).view(1, -1, 1)
        running_mean = self.emb[idx].cumsum(dim=1) / steps
        return self.bigram[idx] + self.context_weight * running_mean @ self.head


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


def make_lm(tokenizer: Tokenizer, max_length: int, batch_size: int = 3, context_weight: float = 1.0) -> KilnLM:
    model = TinyLM(tokenizer.get_vocab_size(), context_weight)
    return KilnLM(model, tokenizer, max_length, tokenizer.token_to_id(EOS), batch_size)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def by_hand(lm: KilnLM, inputs: list[int], targets: list[int]) -> float:
    """Sum over the last len(targets) positions of one unbatched forward pass."""
    with torch.no_grad():
        logprobs = F.log_softmax(lm.model(torch.tensor([inputs])), dim=-1)[0]
    scored = logprobs[len(inputs) - len(targets) :]
    return float(scored.gather(1, torch.tensor(targets).unsqueeze(1)).sum())


def test_registered_as_kiln() -> None:
    assert get_model("kiln") is KilnLM


def test_rolling_short_text_is_one_forward_pass(tokenizer: Tokenizer) -> None:
    lm = make_lm(tokenizer, max_length=64)
    text = SENTENCES[0]
    ids = lm.encode(text)
    assert 5 < len(ids) < 64
    [total] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    expected = by_hand(lm, [lm.eos_id] + ids[:-1], ids)
    assert total == pytest.approx(expected, abs=1e-4)


def test_rolling_long_text_scores_every_token_once(tokenizer: Tokenizer) -> None:
    # A pure bigram model: the true log-likelihood is a sum over (previous, token) pairs,
    # which the windows reproduce only if each token is scored once with its predecessor.
    lm = make_lm(tokenizer, max_length=7, context_weight=0.0)
    text = " ".join(SENTENCES)
    ids = lm.encode(text)
    assert len(ids) > 5 * 7
    table = F.log_softmax(lm.model.bigram.detach(), dim=-1)
    previous = [lm.eos_id] + ids[:-1]
    expected = sum(float(table[p, t]) for p, t in zip(previous, ids, strict=True))
    [total] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert total == pytest.approx(expected, rel=1e-5)


def test_rolling_long_text_uses_lm_eval_windows(tokenizer: Tokenizer) -> None:
    # With context, the last window keeps a full max_length context (lm-eval's scheme).
    lm = make_lm(tokenizer, max_length=8)
    ids = lm.encode(SENTENCES[1])
    assert 8 < len(ids) <= 16
    expected = by_hand(lm, [lm.eos_id] + ids[:7], ids[:8]) + by_hand(lm, ids[len(ids) - 9 : -1], ids[8:])
    [total] = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(SENTENCES[1],)]))
    assert total == pytest.approx(expected, abs=1e-4)


def test_loglikelihood_splits_context_and_continuation(tokenizer: Tokenizer) -> None:
    lm = make_lm(tokenizer, max_length=64)
    context, continuation = "The cat sat on the", " mat"
    whole = lm.encode(context + continuation)
    n_context = len(lm.encode(context))
    [(logprob, _)] = lm.loglikelihood(requests("loglikelihood", [(context + " ", "mat")]))
    # The trailing space moves into the continuation, so both spellings score the same tokens.
    [(same, _)] = lm.loglikelihood(requests("loglikelihood", [(context, continuation)]))
    expected = by_hand(lm, whole[:-1], whole[n_context:])
    assert logprob == pytest.approx(expected, abs=1e-4)
    assert same == pytest.approx(expected, abs=1e-4)


def test_loglikelihood_batched_equals_one_at_a_time(tokenizer: Tokenizer) -> None:
    args = [("", SENTENCES[0]), ("The rain", " fell"), (SENTENCES[3], " The door"), ("A", " dog sat by the door")]
    batched = make_lm(tokenizer, max_length=10, batch_size=3).loglikelihood(requests("loglikelihood", args))
    single = make_lm(tokenizer, max_length=10, batch_size=1).loglikelihood(requests("loglikelihood", args))
    assert [r[1] for r in batched] == [r[1] for r in single]
    assert [r[0] for r in batched] == pytest.approx([r[0] for r in single], abs=1e-4)


def test_continuation_longer_than_context_is_scored_in_chunks(tokenizer: Tokenizer) -> None:
    lm = make_lm(tokenizer, max_length=6, context_weight=0.0)
    ids = lm.encode(SENTENCES[2])
    assert len(ids) > 2 * 6
    table = F.log_softmax(lm.model.bigram.detach(), dim=-1)
    expected = sum(float(table[p, t]) for p, t in zip([lm.eos_id] + ids[:-1], ids, strict=True))
    [(logprob, greedy)] = lm.loglikelihood(requests("loglikelihood", [("", SENTENCES[2])]))
    assert logprob == pytest.approx(expected, rel=1e-5)
    assert greedy is False


def test_is_greedy_matches_argmax(tokenizer: Tokenizer) -> None:
    lm = make_lm(tokenizer, max_length=64, context_weight=0.0)
    sat = tokenizer.token_to_id("Ġsat")
    with torch.no_grad():
        lm.model.bigram[:, sat] += 100.0  # " sat" is now everyone's most likely next token
    [(_, greedy), (_, not_greedy)] = lm.loglikelihood(
        requests("loglikelihood", [("The cat", " sat"), ("The cat", " sat on")])
    )
    assert greedy is True
    assert not_greedy is False


def test_generate_until_stops_at_stop_string(tokenizer: Tokenizer) -> None:
    lm = make_lm(tokenizer, max_length=16, context_weight=0.0)
    the, cat, sat = (tokenizer.token_to_id(t) for t in ("Ġthe", "Ġcat", "Ġsat"))
    with torch.no_grad():  # a deterministic cycle: the -> cat -> sat -> the
        for src, dst in ((the, cat), (cat, sat), (sat, the)):
            lm.model.bigram[src, dst] += 100.0
    free, stopped, stopped_mid = lm.generate_until(
        requests(
            "generate_until",
            [
                ("Look at the", {"until": [], "max_gen_toks": 5}),
                ("Look at the", {"until": [" sat"], "max_gen_toks": 50}),
                ("Look at the", {"until": "at th", "max_gen_toks": 50}),
            ],
        )
    )
    assert free == " cat sat the cat sat"
    assert stopped == " cat"
    assert stopped_mid == " cat s"


def test_generate_until_stops_at_eos(tokenizer: Tokenizer) -> None:
    lm = make_lm(tokenizer, max_length=16, context_weight=0.0)
    cat = tokenizer.token_to_id("Ġcat")
    with torch.no_grad():
        lm.model.bigram[:, cat] += 100.0
        lm.model.bigram[cat, lm.eos_id] += 200.0
    [out] = lm.generate_until(requests("generate_until", [("The", {"until": ["\n"]})]))
    assert out == " cat"
