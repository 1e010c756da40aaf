"""What a training run records, and that a recorded command asks for it again.

The shipped DDQN's ``ddqn.json`` holds the command that trained it and that run's
effective configuration (every TrainConfig and EpisodeDistribution setting). Parsing the
command must give exactly that configuration: a knob dropped from ``kvtransport train``,
or a distribution default moved under a command that does not spell it out, fails here.
"""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from kvtransport.agents.episodes import round_trip, spec_deadline
from kvtransport.agents.training import (
    HARD_VALIDATION_RTTS,
    TrainConfig,
    effective_config,
    hard_validation_specs,
    make_env,
    validation_score,
    validation_specs,
)

from kvtransport.cli import build_parser, main
from kvtransport.commands import train as train_cmd
from kvtransport.policies.ddqn import SHIPPED_WEIGHTS

SIDECAR = SHIPPED_WEIGHTS.with_name("ddqn.json")


def _parse(argv: list[str]) -> tuple[object, TrainConfig]:
    args = build_parser().parse_args(argv)
    return args, train_cmd._config(args)


def _recorded(argv: list[str]) -> tuple[str, dict]:
    """The command and configuration a run started with ``argv`` records."""
    args, cfg = _parse(argv)
    config = effective_config(cfg)
    return train_cmd._command_line(args, config), config


def test_the_shipped_command_parses_to_the_shipped_configuration():
    side = json.loads(SIDECAR.read_text())
    argv = shlex.split(side["command"])
    assert argv[:2] == ["kvtransport", "train"]
    _, cfg = _parse(argv[1:])
    assert effective_config(cfg) == side["config"]
    # the links and prior the shipped weights saw, not today's defaults
    assert side["config"]["distribution"]["rate_range_mbps"] == [20.0, 1000.0]
    assert side["config"]["distribution"]["prior_weights"] == {"none": 1.0}
    assert side["config"]["eval_hard_episodes"] == 40
    # and the weights file records the same
    with np.load(SHIPPED_WEIGHTS, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
    assert (meta["command"], meta["config"]) == (side["command"], side["config"])


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--rate-range", "20,400", "--prior", "none"],
        ["--rate-range", "33.333333333,33.333333333", "--prior", "profile=2,none=0.1234567"],
        ["--handoff-share", "0.1234567", "--prior", "previous", "--seed", "7"],
        ["--prior", "none=0.3,previous=0.5,profile=0.2", "--hidden", "32,16"],
        ["--long-link-min-rtts", "1.25", "--rate-range", "20,1000", "--rho-range", "0.6,2"],
        ["--long-link-deadline-rtts", "1,3.5", "--long-link-min-rtts", "1"],
        ["--eval-hard", "12", "--shortfall-weight", "2.5"],
        ["--expert-realizations", "3", "--seed", "2"],
    ],
)
def test_a_recorded_command_asks_for_the_same_run_again(argv):
    command, config = _recorded(["train", *argv])
    again, config_again = _recorded(shlex.split(command)[1:])
    assert config_again == config
    assert again == command  # every setting spelled out: recording is a fixed point


def test_the_recorded_command_spells_out_the_distribution_defaults():
    """A run on the defaults records their values, so the command still asks for them
    after a default moves."""
    command, config = _recorded(["train"])
    dist = config["distribution"]
    words = shlex.split(command)
    lo, hi = dist["rate_range_mbps"]
    assert words[words.index("--rate-range") + 1] == f"{lo:g},{hi:g}"
    assert "--prior" in words and "--handoff-share" in words
    assert words[words.index("--rho-range") + 1] == ",".join(f"{r:g}" for r in dist["rho_range"])
    assert words[words.index("--long-link-min-rtts") + 1] == f"{dist['high_rtt_min_rtts']:g}"
    _, cfg = _parse(words[1:])
    assert cfg.distribution["prior_weights"] == dist["prior_weights"]


def _draws(cfg: TrainConfig, n: int) -> list:
    """``n`` training episodes as training draws them (the environment ``make_env``
    builds, reset with seeds as SB3 would give them) and ``n`` validation episodes."""
    env = make_env(cfg)
    rng = np.random.default_rng(3)
    train = [env.reset(seed=int(rng.integers(1 << 31)))[1]["spec"] for _ in range(n)]
    return train + validation_specs(cfg, n)


def test_rate_range_rho_range_and_prior_reach_the_draws():
    _, cfg = _parse(["train", "--rate-range", "20,40", "--prior", "none", "--rho-range", "1.5,2"])
    specs = _draws(cfg, 8)
    assert all(20.0 <= s.channel.rate_mbps <= 40.0 for s in specs)
    assert all(1.5 <= s.rho <= 2.0 for s in specs)
    assert all(s.prior_loss is None for s in specs)
    _, cfg = _parse(["train", "--rate-range", "700,700", "--prior", "profile"])
    specs = _draws(cfg, 8)
    assert all(s.channel.rate_mbps == pytest.approx(700.0) for s in specs)
    assert all(s.prior_loss is not None for s in specs)


def test_long_link_min_rtts_reaches_the_draws():
    """Long-link episodes (one way beyond the short links' range) keep deadlines of at
    least ``--long-link-min-rtts`` round trips: the default 2 draws none under two, 1 lets
    the draws between one and two round trips in (fast long links: a 20 MB stream at
    1 Gbit/s over 80 ms one way has about one)."""
    from kvtransport.agents.episodes import round_trip, spec_deadline

    def long_rtts(argv: list[str]) -> list[float]:
        _, cfg = _parse(["train", "--rate-range", "500,1000", *argv])
        env = make_env(cfg)
        specs = [env.reset(seed=s)[1]["spec"] for s in range(60)]
        return [spec_deadline(s) / round_trip(s) for s in specs if s.channel.delay_ms >= 20.0]

    default, one = long_rtts([]), long_rtts(["--long-link-min-rtts", "1"])
    assert default and one
    assert min(default) >= 2.0
    assert min(one) >= 1.0 and any(r < 2.0 for r in one)


def test_long_link_deadline_rtts_sizes_the_long_link_episodes():
    """With ``--long-link-deadline-rtts 1,2`` a long-link episode of a synthetic utility
    has as many blocks as make its deadline 1-2 round trips (up to a block's rounding and
    the block-count bounds), at any rate; without it fast long links rarely get there."""
    from kvtransport.agents.episodes import round_trip, spec_deadline

    def long_specs(argv: list[str]) -> list:
        _, cfg = _parse(["train", "--rate-range", "500,1000", "--long-link-min-rtts", "1", *argv])
        env = make_env(cfg)
        specs = [env.reset(seed=s)[1]["spec"] for s in range(80)]
        return [s for s in specs if s.channel.delay_ms >= 20.0 and s.utility.startswith("zipf")]

    sized = long_specs(["--long-link-deadline-rtts", "1,2"])
    plain = long_specs([])
    assert len(sized) >= 5 and len(plain) >= 2
    for s in sized:
        per_block = spec_deadline(s) / s.n_blocks
        assert round_trip(s) - per_block <= spec_deadline(s) <= 2 * round_trip(s) + per_block
    # sizing gives these episodes more blocks than the short links' draws do
    assert np.mean([s.n_blocks for s in sized]) > 1.5 * np.mean([s.n_blocks for s in plain])


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--eval-hard", "-1"),
        ("--expert-realizations", "0"),
        ("--expert-realizations", "two"),
        ("--eval-hard", "many"),
        ("--shortfall-weight", "-1"),
        ("--shortfall-weight", "nan"),
        ("--long-link-deadline-rtts", "2,1"),
        ("--long-link-deadline-rtts", "0,1"),
        ("--rho-range", "2,1"),
        ("--rho-range", "0,1"),
        ("--rho-range", "1"),
        ("--rho-range", "1,inf"),
        ("--long-link-min-rtts", "-1"),
        ("--long-link-min-rtts", "nan"),
        ("--long-link-min-rtts", "soon"),
        ("--rate-range", "400,20"),  # inverted
        ("--rate-range", "0,100"),
        ("--rate-range", "-5,10"),
        ("--rate-range", "nan,10"),
        ("--rate-range", "10,inf"),
        ("--rate-range", "100"),
        ("--rate-range", "10,20,30"),
        ("--rate-range", "fast,slow"),
        ("--prior", "none=-1"),
        ("--prior", "none=0"),
        ("--prior", "none,none"),
        ("--prior", "none=x"),
        ("--prior", "=1"),
    ],
)
def test_a_bad_value_is_a_one_line_usage_error(option, value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[-1]


def test_an_unknown_prior_kind_is_a_one_line_error(tmp_path, capsys):
    code = main(["train", "--prior", "none=1,guess=1", "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prior" in err[0] and "'guess'" in err[0]
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_init_from_is_recorded_and_asks_for_the_same_run_again():
    argv = ["train", "--handoff-share", "0.3", "--init-from", str(SHIPPED_WEIGHTS)]
    command, config = _recorded(argv)
    assert config["init_from"] == str(SHIPPED_WEIGHTS)
    words = shlex.split(command)
    assert words[words.index("--init-from") + 1] == str(SHIPPED_WEIGHTS)
    again, config_again = _recorded(words[1:])
    assert (again, config_again) == (command, config)
    # a run from random weights records no init_from (as runs before the option did)
    assert "init_from" not in _recorded(["train"])[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--init-from", "no/such/ddqn.npz"], "no such DDQN weights file"),
        (["--init-from", str(SHIPPED_WEIGHTS), "--hidden", "32,32"], "hidden layers are 64,64"),
    ],
)
def test_a_bad_init_from_is_a_one_line_error(argv, message, tmp_path, capsys):
    code = main(["train", *argv, "--out", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


def test_validation_overrides_change_the_validation_episodes_only():
    """``TrainConfig.validation``: the checkpoint is picked on episodes drawn with these
    fields changed (here long-link handoffs), the training draws stay the distribution's,
    and the run records the overrides only when set."""
    base = TrainConfig(steps=10, distribution={"handoff_share": 0.3})
    cfg = TrainConfig(steps=10, distribution={"handoff_share": 0.3},
                      validation={"handoff_share": 1.0, "high_rtt_share": 1.0})  # fmt: skip
    val = validation_specs(cfg, 6)
    assert all(s.stream == "handoff" and s.channel.delay_ms >= 20.0 for s in val)
    assert validation_specs(base, 6) != val
    env_a, env_b = make_env(base), make_env(cfg)
    for seed in (1, 2, 3):
        a = env_a.reset(seed=seed)[1]["spec"]
        assert a == env_b.reset(seed=seed)[1]["spec"]
    assert "validation" not in effective_config(base)
    assert effective_config(cfg)["validation"] == {"handoff_share": 1.0, "high_rtt_share": 1.0}


def test_hard_validation_options_reach_the_run_and_are_recorded():
    command, config = _recorded(["train", "--eval-hard", "12", "--shortfall-weight", "2.5"])
    assert (config["eval_hard_episodes"], config["shortfall_weight"]) == (12, 2.5)
    words = shlex.split(command)
    assert words[words.index("--eval-hard") + 1] == "12"
    assert words[words.index("--shortfall-weight") + 1] == "2.5"
    # a run without them records what runs did before the options existed
    plain = _recorded(["train"])[1]
    assert "eval_hard_episodes" not in plain and "shortfall_weight" not in plain


def test_expert_realizations_reach_the_run_and_are_recorded_only_when_set():
    command, config = _recorded(["train", "--expert-realizations", "2"])
    assert config["expert_realizations"] == 2
    words = shlex.split(command)
    assert words[words.index("--expert-realizations") + 1] == "2"
    command, config = _recorded(["train"])
    assert "expert_realizations" not in config and "--expert-realizations" not in command


def test_hard_validation_episodes_are_fast_long_links_at_one_or_two_round_trips():
    """The added validation episodes are the cells where networks lose to adaptive: long
    links, the upper half of the run's rates (log scale), deadlines of 1-2 round trips,
    synthetic utilities, held-out seeds apart from the ordinary validation's."""
    cfg = TrainConfig(distribution={"rate_range_mbps": (20.0, 1000.0), "handoff_share": 0.3})
    hard = hard_validation_specs(cfg, 24)
    assert len(hard) == 24 and hard == hard_validation_specs(cfg, 24)  # fixed
    lo, hi = HARD_VALIDATION_RTTS
    for s in hard:
        assert s.channel.delay_ms >= 20.0 and s.stream == "utility"
        assert (20.0 * 1000.0) ** 0.5 <= s.channel.rate_mbps <= 1000.0
        assert not s.utility.startswith("measured")
        rtts = spec_deadline(s) / round_trip(s)
        assert lo * 0.99 <= rtts <= hi * 1.01 or s.n_blocks == 100  # sizing's floor
    ordinary = validation_specs(cfg, 24)
    assert not {s.seed for s in hard} & {s.seed for s in ordinary}
    # the ordinary validation draws mostly other links: few fast long links at <= 2 RTTs
    fast_short = [s for s in ordinary if s.channel.delay_ms >= 20.0
                  and s.channel.rate_mbps >= 141.0
                  and spec_deadline(s) <= 2 * round_trip(s)]  # fmt: skip
    assert len(fast_short) < 6
    assert hard_validation_specs(cfg, 0) == []


def test_the_validation_score_charges_shortfalls_below_the_better_heuristic():
    best = np.array([0.8, 0.6])
    greedy = np.array([0.95, 0.5])  # higher mean, falls 0.1 short on the second episode
    steady = np.array([0.8, 0.6])
    assert validation_score(greedy, best, 0.0) == (pytest.approx(0.725), pytest.approx(0.05))
    assert validation_score(greedy, best, 2.0)[0] == pytest.approx(0.625)
    assert validation_score(steady, best, 2.0) == (pytest.approx(0.7), 0.0)
    # the weight decides which checkpoint a run keeps
    assert validation_score(greedy, best, 0.0)[0] > validation_score(steady, best, 0.0)[0]
    assert validation_score(greedy, best, 2.0)[0] < validation_score(steady, best, 2.0)[0]


def test_an_expert_chosen_over_several_draws_is_the_best_on_average_not_in_hindsight():
    """ge-heavy at 80 ms one way, deadline 1.6 send times: on the episode's own draw the
    tail rule alone recovers the most, over two draws of the channel the adaptive
    heuristic's margin does (found by search; each draw plays all five candidates; seed 5
    until RLC's last-round margin learnt bursts moved ge-heavy's outcomes)."""
    from kvtransport.agents.episodes import EpisodeSpec
    from kvtransport.agents.training import best_demonstrator
    from kvtransport.netem import load_profile

    link = load_profile("ge-heavy").with_overrides(delay_ms=80)
    spec = EpisodeSpec(seed=11, channel=link, feedback=link, rho=1.6, n_blocks=300)
    assert best_demonstrator(spec) == "tail"
    assert best_demonstrator(spec, realizations=2) == "adaptive:2"
