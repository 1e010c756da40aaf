"""Answer-quality measures: exact match, containment and token F1 against gold answers.

Normalization follows the SQuAD evaluation script's rules (lower case, drop punctuation and
the articles a/an/the, collapse white space), so "The Euro." and "euro" match. With several
gold answers, exact match, containment and F1 take the best gold (SQuAD's max over
references); ``contains_all`` is the fraction of golds found, RULER's ``string_match_all``
for multi-value needles. Teacher-forced top-1 agreement needs the model and lives in
``kvtransport.model.hf.top1_agreement``.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower, strip punctuation and articles, collapse spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    out = [golds] if isinstance(golds, str) else list(golds)
    if not out:
        raise ValueError("at least one gold answer is needed")
    return out


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalized prediction equals some normalized gold answer, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def _contains(prediction_norm: str, gold: str) -> bool:
    g = normalize_answer(gold)
    # Whole-token containment: "4823917" is not found inside "48239170".
    return bool(g) and f" {g} " in f" {prediction_norm} "


def contains(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 if some gold answer appears (as whole tokens) in the prediction, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(_contains(p, g) for g in _golds(golds)))


def contains_all(prediction: str, golds: str | Iterable[str]) -> float:
    """Fraction of the gold answers that appear in the prediction (RULER string_match_all)."""
    p = normalize_answer(prediction)
    gs = _golds(golds)
    return sum(_contains(p, g) for g in gs) / len(gs)


def _f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """SQuAD token-level F1 between prediction and the best-matching gold answer."""
    p = normalize_answer(prediction).split()
    return max(_f1(p, normalize_answer(g).split()) for g in _golds(golds))


def score_answer(prediction: str, golds: str | Iterable[str]) -> dict[str, float]:
    """All text measures at once: em, contains, contains_all, f1."""
    return {
        "em": exact_match(prediction, golds),
        "contains": contains(prediction, golds),
        "contains_all": contains_all(prediction, golds),
        "f1": token_f1(prediction, golds),
    }
