"""`--model DIR|GGUF` on the commands that load a model: a user's own model directory
(here a tiny random-weight Mistral with a 32-token sliding window, SmolLM2's tokenizer)
runs prefill and answer end to end, the card's answer equal to re-prefilling's; a path
that is not a model, or a model the race cannot serve exactly, is a one-line error."""

import json

import pytest
import torch
import transformers as tf

from kvtransport.cli import main

pytestmark = pytest.mark.model

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)  # fmt: skip


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _save(directory, config, tokenizer):
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def windowed_dir(smollm, tmp_path_factory):
    vocab = len(smollm.tokenizer)
    cfg = tf.MistralConfig(**SHAPE, vocab_size=vocab, sliding_window=32,
                           eos_token_id=smollm.tokenizer.eos_token_id)  # fmt: skip
    return _save(tmp_path_factory.mktemp("tiny-mistral"), cfg, smollm.tokenizer)


def test_own_model_directory_prefill_then_answer(capsys, tmp_path, windowed_dir):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The report was written by Ada in Lisbon, on a rainy day. " * 12)
    card = tmp_path / "c.card"
    q = "Who wrote the report?"
    code, _, err = _run(capsys, "prefill", "--model", windowed_dir, "--context", ctx,
                        "--out", card, "--threads", 1, "--precision", "fp32")  # fmt: skip
    assert code == 0, err
    code, out, err = _run(capsys, "answer", "--model", windowed_dir, "--card", card,
                          "--question", q, "--json", "--threads", 1)  # fmt: skip
    assert code == 0, err
    from_card = json.loads(out)
    code, out, err = _run(capsys, "answer", "--model", windowed_dir, "--context", ctx,
                          "--question", q, "--json", "--threads", 1)  # fmt: skip
    assert code == 0, err
    assert from_card["tokens"] and from_card["tokens"] == json.loads(out)["tokens"]
    # the card is the tiny model's: the default model refuses it
    code, _, err = _run(capsys, "answer", "--card", card, "--question", q, "--threads", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["demo", "prefill", "answer", "profile"])
@pytest.mark.parametrize("what", ["missing", "text-file", "fake-gguf", "no-config", "gemma2"])
def test_a_path_that_is_not_a_usable_model_is_a_one_line_error(
    capsys, tmp_path, smollm, command, what
):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("Some context. " * 20)
    model = {
        "missing": tmp_path / "nowhere",
        "text-file": ctx,
        "fake-gguf": tmp_path / "fake.gguf",
        "no-config": tmp_path,
        "gemma2": tmp_path / "gemma2",
    }[what]
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    if what == "gemma2":
        cfg = tf.Gemma2Config(**SHAPE, head_dim=16, vocab_size=len(smollm.tokenizer))
        _save(model, cfg, smollm.tokenizer)
        capsys.readouterr()  # the save's own progress bar
    argv = {
        "demo": ["--quick", "--link", "emulated", "--no-card-cache"],
        "prefill": ["--context", ctx, "--out", tmp_path / "c.card"],
        "answer": ["--context", ctx, "--question", "q"],
        "profile": ["--samples", 1, "--out", tmp_path / "p.json"],
    }[command]
    code, _, err = _run(capsys, command, "--model", model, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    needle = {"missing": "unknown model", "text-file": "neither a .gguf", "fake-gguf": "magic",
              "no-config": "neither a .gguf", "gemma2": "soft-capping"}[what]  # fmt: skip
    assert needle in err, err
