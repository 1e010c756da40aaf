"""The chat-templated prompt of a handoff, split where the KV cache changes hands.

Tokenizer-only (no model, no torch): kvtransport.model.hf prefills a context with it, and
kvtransport.model.loader re-exports it next to ``load_model``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedTokenizerBase


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str = "",
    *,
    answer_prefix: str = "",
    separator: str = "\n",
) -> tuple[list[int], list[int]]:
    """Token ids of a chat-templated prompt, split where the KV-cache handoff happens.

    The user turn is ``context + separator + question``. Returns ``(context_ids,
    question_ids)``: context_ids are everything up to and including the context and the
    separator (what the upstream agent prefills and ships), question_ids the rest (the
    question, the end of the user turn, the assistant header and ``answer_prefix``).
    Both halves are tokenized on their own, exactly as a receiver appending a question to
    a received cache would; re-prefilling ``context_ids + question_ids`` is therefore the
    same computation as injecting the cache and feeding ``question_ids``.
    """
    sentinel = "\x00KVT-SPLIT\x00"
    content = f"{context}{separator}{sentinel}{question}"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:  # a base model: plain text
        text = content
    if text.count(sentinel) != 1:
        raise ValueError("the chat template altered the prompt; cannot find the split point")
    head, tail = text.split(sentinel)
    tail += answer_prefix
    ctx = tokenizer(head, add_special_tokens=False)["input_ids"]
    qst = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return list(ctx), list(qst)
