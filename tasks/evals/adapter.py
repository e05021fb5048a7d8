"""Kiln's lm-eval model adapter: scores text with a Kiln model and its BPE tokenizer.

`KilnLM` implements lm-eval's three request types on CPU for any causal `torch.nn.Module`
that maps token ids `[B, T]` to logits `[B, T, V]`. It is registered as lm-eval model
`kiln`, so once this module is imported (e.g. `python -c "import tasks.evals.adapter;
from lm_eval.__main__ import cli_evaluate; cli_evaluate()" --model kiln --model_args
model_dir=...,tokenizer=...`) the lm-eval CLI can load a Kiln checkpoint by path.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tokenizers import Tokenizer

from kiln.tasks.train.model import load_model

# lm-eval's own default for generate_until when a task gives no max_gen_toks.
DEFAULT_MAX_GEN_TOKS = 256


@register_model("kiln")
class KilnLM(LM):
    """A Kiln model and tokenizer behind lm-eval's `LM` interface (greedy unless a task samples, CPU, no grad)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        max_length: int,
        eos_id: int,
        batch_size: int = 8,
    ) -> None:
        super().__init__()
        assert max_length >= 1 and batch_size >= 1
        # Evaluation must not see dropout; the caller hands the model over for scoring.
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.eos_id = eos_id
        self.batch_size = batch_size
        self._device = torch.device("cpu")

    @classmethod
    def from_dirs(cls, model_dir: Path, tokenizer_path: Path, batch_size: int = 8) -> KilnLM:
        """Load a trained model directory and a `tokenizer.json` file."""
        # Imported here so the adapter (and its tests) do not depend on the training code.

        model, config = load_model(Path(model_dir))
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        return cls(model, tokenizer, config.max_seq_len, _eos_id(tokenizer, tokenizer_path), batch_size)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> KilnLM:
        """`model_dir=DIR,tokenizer=FILE[,batch_size=N]`, as the lm-eval CLI passes it."""
        args = simple_parse_args_string(arg_string)
        missing = {"model_dir", "tokenizer"} - args.keys()
        if missing:
            raise ValueError(
                f"--model_args for kiln is missing {sorted(missing)}: "
                "pass model_dir=<trained model dir>,tokenizer=<tokenizer.json>"
            )
        # The CLI's --batch_size arrives in additional_config; explicit model_args win.
        batch_size = args.get("batch_size") or (additional_config or {}).get("batch_size") or 8
        return cls.from_dirs(Path(args["model_dir"]), Path(args["tokenizer"]), int(batch_size))

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> KilnLM:
        arg_string = ",".join(f"{key}={value}" for key, value in arg_dict.items())
        return cls.create_from_arg_string(arg_string, additional_config)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    # ---- request types -------------------------------------------------------------

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        # A continuation longer than the model's context is scored in consecutive chunks, each
        # conditioned on everything before it (left-truncated like any input): exact, not cut.
        chunks: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for index, request in enumerate(requests):
            context, continuation = self._encode_pair(*request.args)
            for start in range(0, len(continuation), self.max_length):
                chunks.append((context + continuation[:start], continuation[start : start + self.max_length]))
                owner.append(index)
        totals = [0.0] * len(requests)
        greedy = [True] * len(requests)
        for index, (logprob, is_greedy) in zip(owner, self._score(chunks), strict=True):
            totals[index] += logprob
            greedy[index] = greedy[index] and is_greedy
        return list(zip(totals, greedy, strict=True))

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        windows: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(
                token_list=self.encode(text),
                prefix_token=self.eos_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append(make_disjoint_window(window))
                owner.append(index)
        totals = [0.0] * len(requests)
        # All windows of all documents share batches; each window is scored exactly once.
        for index, (logprob, _) in zip(owner, self._score(windows), strict=True):
            totals[index] += logprob
        return totals

    def generate_until(self, requests: list[Any]) -> list[str]:
        return [self._generate(context, dict(gen_kwargs)) for context, gen_kwargs in (r.args for r in requests)]

    # ---- scoring -------------------------------------------------------------------

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token-level split: the continuation's tokens are those the joint text adds to the context's.

        Trailing spaces move from context to continuation first (as lm-eval's HF model does), so
        BPE merges a leading space into the continuation's first token as it would in running text.
        """
        stripped = context.rstrip()
        continuation = context[len(stripped) :] + continuation
        context = stripped
        if not context:
            # The first token must be predicted from something: the end-of-text token.
            return [self.eos_id], self.encode(continuation)
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        if whole[: len(context_ids)] != context_ids:
            # A merge crossed the boundary; score the continuation as its own tokens.
            return context_ids, self.encode(continuation)
        return context_ids, whole[len(context_ids) :]

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log-probs of each continuation given its context, and whether greedy decoding
        would have produced it; the input is left-truncated to `max_length` tokens."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        # Longest first so each batch pads little; results are put back in request order.
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            inputs, spans = [], []
            for i in batch:
                context, continuation = pairs[i]
                assert 1 <= len(continuation) <= self.max_length, "callers chunk continuations"
                tokens = (context + continuation)[-(self.max_length + 1) :][:-1]
                inputs.append(tokens)
                spans.append(len(continuation))
            width = max(len(tokens) for tokens in inputs)
            # Right padding never influences earlier positions of a causal model.
            padded = torch.full((len(batch), width), self.eos_id, dtype=torch.long)
            for row, tokens in enumerate(inputs):
                padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs = F.log_softmax(self.model(padded).float(), dim=-1)
            for row, i in enumerate(batch):
                end, span = len(inputs[row]), spans[row]
                target = torch.tensor(pairs[i][1], dtype=torch.long)
                window = logprobs[row, end - span : end]
                picked = window.gather(1, target.unsqueeze(1)).squeeze(1)
                results[i] = (float(picked.sum()), bool((window.argmax(-1) == target).all()))
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        until = gen_kwargs.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        max_gen_toks = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        # Sampling (do_sample, temperature) draws from a generator seeded by the context, so a rerun
        # samples the same continuation; otherwise greedy.
        temperature = float(gen_kwargs.pop("temperature", 1.0)) if gen_kwargs.pop("do_sample", False) else 0.0
        generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(context.encode()).digest()[:8], "little"))
        tokens = self.encode(context) or [self.eos_id]
        generated: list[int] = []
        text = ""
        for _ in range(max_gen_toks):
            logits = self.model(torch.tensor([tokens[-self.max_length :]], dtype=torch.long))
            if temperature > 0:
                probs = F.softmax(logits[0, -1].float() / temperature, dim=-1)
                next_id = int(torch.multinomial(probs, 1, generator=generator))
            else:
                next_id = int(logits[0, -1].argmax())
            if next_id == self.eos_id:
                break
            tokens.append(next_id)
            generated.append(next_id)
            text = self.tokenizer.decode(generated)
            if any(stop in text for stop in until):
                break
        cut = min((text.index(stop) for stop in until if stop in text), default=len(text))
        return text[:cut]


def _eos_id(tokenizer: Tokenizer, tokenizer_path: Path) -> int:
    """The end-of-text id: the tokenizer's first special token that names end of text."""
    for name in ("<|endoftext|>", "</s>", "<eos>", "[EOS]"):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise ValueError(
        f"{tokenizer_path} has no end-of-text token (<|endoftext|>, </s>, <eos> or [EOS]); "
        "train the tokenizer with one as a special token"
    )
