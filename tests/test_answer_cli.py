"""`kvtransport prefill` / `answer`: same answer from a card and from re-prefilling; errors."""

import json

import pytest

from kvtransport.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["answer", "--card", "{tmp}/none.card", "--question", "q"], "no such file"),
        (["answer", "--context", "{tmp}/ctx.txt", "--question", "q", "--drop", "1.5"], "--drop"),
        (["answer", "--context", "{tmp}/ctx.txt", "--question", "q", "--precision", "fp8"], "fp8"),
        (["answer", "--context", "{tmp}/none.txt", "--question", "q"], "no such file"),
        (["answer", "--context", "{tmp}/empty.txt", "--question", "q"], "empty"),
        (["answer", "--card", "{tmp}/ctx.txt", "--question", "q"], "not a cache card"),
        (["prefill", "--context", "{tmp}/ctx.txt", "--out", "{tmp}/no/dir.card"], "not exist"),
        (
            ["prefill", "--context", "{tmp}/ctx.txt", "--out", "x", "--precision", "mixed:0"],
            "mixed",
        ),
        (["card", "inspect", "{tmp}/ctx.txt"], "not a cache card"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, tmp_path, argv, needle):
    (tmp_path / "ctx.txt").write_text("Some context that is plainly not a card. " * 20)
    (tmp_path / "empty.txt").write_text("  \n")
    code, out, err = _run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err, err


@pytest.mark.model
def test_card_and_reprefill_give_the_same_answer(capsys, tmp_path, smollm):
    from kvtransport.model import tasks

    sample = tasks.generate("facts_qa", smollm.tokenizer, target_tokens=220, seed=31337)
    ctx = tmp_path / "facts.txt"
    ctx.write_text(sample.context)
    path = tmp_path / "facts.card"
    code, out, err = _run(capsys, "prefill", "--context", str(ctx), "--out", str(path), "--json")
    assert code == 0, err
    made = json.loads(out)
    assert made["tokens"] > 150 and path.stat().st_size == made["bytes"]

    q = ["--question", sample.question, "--json", "--threads", "1", "--max-new-tokens", "24"]
    code, out, err = _run(capsys, "answer", "--card", str(path), *q)
    assert code == 0, err
    from_card = json.loads(out)
    code, out, err = _run(capsys, "answer", "--context", str(ctx), *q)
    assert code == 0, err
    from_context = json.loads(out)
    assert from_card["answer"] and from_card["answer"] == from_context["answer"]
    assert from_card["tokens"] == from_context["tokens"]
    assert from_card["source"] == "card" and from_context["source"] == "prefill"
    for key in ("injection", "first_token", "read_card"):
        assert from_card["timings"][key] > 0
    assert from_context["timings"]["prefill"] > 0
    b = from_card["blocks"]
    assert b["used"] == b["total"] == made["blocks"] and b["missing"] == 0

    # degraded: the last 75 % of a position-ordered int4 stream never arrived
    code, out, err = _run(
        capsys, "answer", "--card", str(path), *q, "--drop", "0.75", "--order", "position",
        "--precision", "int4",
    )  # fmt: skip
    assert code == 0, err
    b = json.loads(out)["blocks"]
    assert b["sent"] == made["blocks"] and b["missing"] == round(0.75 * made["blocks"])
    assert b["precisions"] == {"int4": b["used"]} and 0 < b["utility_used"] < 1
    assert b["order"] == "position"

    # --complete: the dropped tail (fp32 blocks kept) is recomputed from the card's token
    # ids, and the answer is the full card's again, token for token
    drop = ["--drop", "0.3", "--order", "utility"]
    code, out, err = _run(capsys, "answer", "--card", str(path), *q, *drop, "--complete")
    assert code == 0, err
    done = json.loads(out)
    assert done["blocks"]["missing"] > 0 and done["blocks"]["recomputed_tokens"] > 0
    assert done["tokens"] == from_card["tokens"]
