"""``kvtransport train --handoff-share``: the share reaches the training episodes' draws."""

from __future__ import annotations

import numpy as np
import pytest
from kvtransport.agents.training import TrainConfig, effective_config, make_env, validation_specs

from kvtransport.cli import build_parser
from kvtransport.commands import train as train_cmd


def _config(*argv: str) -> TrainConfig:
    return train_cmd._config(build_parser().parse_args(["train", *argv]))


def _streams(cfg: TrainConfig, n: int) -> list[str]:
    """The streams of ``n`` episodes drawn the way training draws them (the environment
    ``make_env`` builds, reset with the seeds SB3 would give it)."""
    env = make_env(cfg)
    rng = np.random.default_rng(7)
    return [env.reset(seed=int(rng.integers(1 << 31)))[1]["spec"].stream for _ in range(n)]


def test_handoff_share_reaches_the_training_draws():
    cfg = _config("--handoff-share", "0.6")
    streams = _streams(cfg, 10)
    assert 2 <= streams.count("handoff") <= 9  # seeded: 0.6 of 10 draws, not none, not all
    assert {s.stream for s in validation_specs(cfg, 6)} == {"utility", "handoff"}
    only = _streams(_config("--handoff-share", "1"), 3)
    assert only == ["handoff"] * 3


def test_default_training_draws_no_handoff_episodes():
    cfg = _config()
    assert cfg.distribution == {}  # the distribution's defaults, draw for draw
    assert set(_streams(cfg, 8)) == {"utility"}


def test_recorded_command_reproduces_the_share():
    args = build_parser().parse_args(["train", "--handoff-share", "0.35", "--steps", "5"])
    config = effective_config(train_cmd._config(args))
    recorded = train_cmd._command_line(args, config).split()
    assert recorded[recorded.index("--handoff-share") + 1] == "0.35"
    again = train_cmd._config(build_parser().parse_args(recorded[1:]))
    assert again.distribution["handoff_share"] == 0.35
    assert effective_config(again) == config


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan", "half"])
def test_bad_handoff_share_is_a_one_line_error(value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", "--handoff-share", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--handoff-share" in err[0]
