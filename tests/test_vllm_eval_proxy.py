"""scripts/eval_vllm.py's proxy flow without vLLM (the main environment): the modes'
order per round (interleaved, ``warm`` after the prompt's cold push), the mode lists it
refuses, and the per-request timeline from the proxy's row and the two engines' logs."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_vllm.py"


def _script():
    spec = importlib.util.spec_from_file_location("eval_vllm", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rounds_rotate_the_modes_and_warm_follows_the_cold_push():
    ev = _script()
    modes = ("own", "planned", "warm")
    orders = [ev._round_order(modes, i) for i in range(3)]
    for order in orders:
        assert sorted(order) == sorted(modes)
        assert order.index("planned") < order.index("warm")  # the context is cached by then
    # interleaved: own takes every place over three rounds
    assert {o.index("own") for o in orders} == {0, 1, 2}
    # without warm it is a plain rotation
    assert ev._round_order(("own", "lossless", "planned"), 1) == ("planned", "own", "lossless")


def test_mode_lists_the_flow_cannot_run_are_refused():
    ev = _script()
    ev.check_modes(("own", "planned", "warm"))
    ev.check_modes(("own", "lossless", "planned"))
    for bad in (("own", "lossless", "planned", "warm"), ("planned", "warm"), ("own", "x")):
        with pytest.raises(SystemExit):
            ev.check_modes(bad)


def test_timeline_puts_every_engine_event_on_the_proxy_clock():
    ev = _script()
    t0 = 1000.0
    row = {"t0": t0, "prefill_reply_s": 0.05, "decode_recv_s": 0.06, "client_ttft_s": 0.5}
    push = {"times": {"t_finished": t0 + 0.04, "t_copy_start": t0 + 0.045,
                      "t_copy_end": t0 + 0.07, "t_encode_start": t0 + 0.071,
                      "t_encode_end": t0 + 0.2, "t_end": t0 + 0.6}}  # fmt: skip
    load = {"times": {"t_claimed": t0 + 0.061, "t_taken": t0 + 0.4, "t_loaded": t0 + 0.45}}
    line = ev.timeline(row, push, load)
    assert list(line) == [name for name, _, _ in ev.TIMELINE]  # every event, in order
    assert line["prefill_reply"] == 50.0 and line["copy_end"] == 70.0
    assert line["push_arrived"] == 400.0 and line["first_token"] == 500.0
    # own prefill: no push, no load; only the proxy's own events
    own = ev.timeline({"t0": t0, "decode_recv_s": 0.001, "client_ttft_s": 2.0}, {}, {})
    assert own == {"decode_request": 1.0, "first_token": 2000.0}
