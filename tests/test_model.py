"""The model loader: GGUF -> cached safetensors copy, model resolution, chat prompts."""

import pytest
import torch

from kvtransport.errors import UserError
from kvtransport.model import tasks
from kvtransport.model.loader import (
    chat_prompt,
    converted_dir,
    default_gguf_path,
    load_gguf_model,
    load_model,
    resolve_model,
)


@pytest.mark.model
def test_safetensors_copy_gives_the_gguf_logits(smollm):
    """The cached copy holds exactly the weights transformers de-quantizes from the GGUF."""
    gguf = default_gguf_path()
    assert smollm.path == converted_dir(gguf)
    assert smollm.model_id == "SmolLM2-135M-Instruct.Q4_1"
    ref = load_gguf_model(gguf)
    assert ref.config.num_hidden_layers == smollm.num_layers == 30
    assert (smollm.num_kv_heads, smollm.head_dim) == (3, 64)
    ctx, q = chat_prompt(smollm.tokenizer, "Paris is the capital of France.", "What is it?")
    ids = torch.tensor([ctx + q])
    with torch.inference_mode():
        got = smollm.model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    assert got.dtype == want.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    # the weights themselves are bit-identical
    ours = smollm.model.state_dict()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.model
def test_cached_copy_is_complete_and_loads_as_a_directory(smollm):
    copy = smollm.path
    names = {p.name for p in copy.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert "quantization_config" not in (copy / "config.json").read_text()
    # no half-written temporaries left next to it
    assert not [p for p in copy.parent.iterdir() if p.name.startswith(f".{copy.name}.")]
    again = load_model(copy, threads=1)
    assert again.source == "directory"
    assert again.model_id == smollm.model_id  # a cache from either path fits the other
    assert again.tokenizer.chat_template == smollm.tokenizer.chat_template


def test_model_argument_errors_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown model"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="neither a .gguf"):
        resolve_model(tmp_path / "notes.txt")
    with pytest.raises(UserError, match="neither a .gguf"):
        resolve_model(tmp_path)  # a directory without config.json
    assert resolve_model(None) == ("gguf", default_gguf_path())
    assert resolve_model("SmolLM2")[0] == "gguf"
    with pytest.raises(UserError, match="at least 1"):
        load_model(threads=0)


@pytest.mark.model
def test_chat_prompt_splits_the_templated_prompt_seamlessly(smollm):
    tok = smollm.tokenizer
    sample = tasks.generate("facts_qa", tok, target_tokens=200, seed=3)
    ctx, q = sample.prompt(tok)
    text = tok.apply_chat_template(
        [{"role": "user", "content": sample.context + "\n" + sample.question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    whole = tok(text + sample.answer_prefix, add_special_tokens=False)["input_ids"]
    assert ctx + q == whole
    assert tok.decode(ctx).endswith(sample.context.splitlines()[-1] + "\n")
    assert tok.decode(q).startswith(sample.question)
    assert tok.decode(q).endswith("assistant\n" + sample.answer_prefix)
    # the question half does not depend on the context
    assert (
        chat_prompt(tok, "something else entirely", sample.question)[1]
        == q[: len(q) - len(tok(sample.answer_prefix, add_special_tokens=False)["input_ids"])]
    )


def test_a_damaged_converted_copy_is_a_user_error_that_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("KVT_CACHE", str(tmp_path))
    copy = converted_dir(default_gguf_path())
    assert copy.is_relative_to(tmp_path)
    copy.mkdir(parents=True)
    (copy / "config.json").write_text('{"model_type": "llama"}')  # weights missing
    with pytest.raises(UserError, match=f"delete {copy}"):
        load_model()
