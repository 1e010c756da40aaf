"""Layer sensitivity: the weight mapping, the noise, KL under noise, the profile command."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from kvtransport import cli
from kvtransport.errors import UserError
from kvtransport.kvformat.kvcache import KVCache
from kvtransport.model import hf, sensitivity, tasks


def test_layer_weights_formula_by_hand():
    # log scale: log-scores 0, ln 10, ln 100 -> s_hat 0, 1/2, 1 -> 4**s_hat = 1, 2, 4
    w = sensitivity.layer_weights([1.0, 10.0, 100.0], ratio=4.0)
    assert np.allclose(w, np.array([1, 2, 4]) / 7)
    # linear scale: s_hat = 0, 9/99, 1
    w = sensitivity.layer_weights([1.0, 10.0, 100.0], ratio=4.0, scale="linear")
    raw = np.array([1.0, 4 ** (9 / 99), 4.0])
    assert np.allclose(w, raw / raw.sum())
    assert w[2] / w[0] == pytest.approx(4.0)  # the ratio is the max/min weight ratio
    assert np.allclose(sensitivity.layer_weights([3.0, 1.0, 2.0], ratio=1.0), 1 / 3)
    assert np.allclose(sensitivity.layer_weights([0.5, 0.5]), 0.5)  # no spread: uniform
    order = np.argsort(sensitivity.layer_weights([0.2, 0.01, 0.05, 3.0]))
    assert order.tolist() == [1, 2, 0, 3]  # monotone in the score
    for bad in ([], [1.0, -1.0], [1.0, math.nan]):
        with pytest.raises(ValueError):
            sensitivity.layer_weights(bad)
    with pytest.raises(ValueError, match="ratio"):
        sensitivity.layer_weights([1.0, 2.0], ratio=0.5)
    with pytest.raises(ValueError, match="scale"):
        sensitivity.layer_weights([1.0, 2.0], scale="sqrt")


def test_value_noise_is_norm_adaptive_and_confined_to_one_layer():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((4, 2, 300, 64)).astype(np.float32)
    # tokens of very different loudness
    values = keys * rng.uniform(0.01, 100, size=(1, 1, 300, 1)).astype(np.float32)
    kv = KVCache(keys, values, np.arange(300), "toy")
    noisy = sensitivity.add_value_noise(kv, 2, 0.5, np.random.default_rng(1))
    assert np.array_equal(noisy.keys, kv.keys)
    assert np.array_equal(noisy.values[[0, 1, 3]], kv.values[[0, 1, 3]])
    rel = np.linalg.norm(noisy.values[2] - kv.values[2], axis=-1) / np.linalg.norm(
        kv.values[2], axis=-1
    )
    assert rel.mean() == pytest.approx(0.5, rel=0.05)
    assert rel.std() < 0.1  # the same relative damage for loud and quiet tokens
    zero = sensitivity.add_value_noise(kv, 2, 0.0, np.random.default_rng(1))
    assert np.array_equal(zero.values, kv.values)
    assert kv.values is not noisy.values  # the input is not modified


@pytest.mark.model
def test_noising_a_layer_moves_the_output_distribution(smollm):
    model, tok = smollm
    ctx, question = tasks.generate("niah_single", tok, target_tokens=200, seed=5).prompt(tok)
    kv = hf.prefill(model, tok, ctx, attention=False)
    clean, _ = hf.cache_forward(model, kv, question, last=1)
    kl = {}
    for scale in (0.0, 0.5, 2.0):
        kl[scale] = sensitivity.layer_kl(
            model, kv, question, 18, scale=scale, rng=np.random.default_rng(0), clean_logits=clean
        )
    assert kl[0.0] == 0.0
    assert 0 < kl[0.5] < kl[2.0]
    assert sensitivity.kl_divergence(clean, clean) == 0.0


@pytest.mark.model
def test_profile_command_writes_a_positive_per_layer_profile(smollm, tmp_path):
    out = tmp_path / "prof.json"
    argv = ["profile", "--samples", "1", "--target-tokens", "160", "--continuation", "2"]
    assert cli.main([*argv, "--out", str(out), "--threads", "1", "--quiet"]) == 0
    prof = sensitivity.load_profile(out)
    assert prof.model_id == smollm.model_id and prof.num_layers == 30
    kl = np.array(prof.kl)
    assert np.all(np.isfinite(kl)) and np.all(kl > 0)
    assert kl.max() > 10 * kl.min()  # layers differ, by orders of magnitude
    assert prof.command.startswith("kvtransport profile ") and "--samples 1" in prof.command
    assert prof.calibration["samples"] == 1 and prof.noise_scale == 1.0
    w = np.array(prof.layer_weights)  # stored with the default ratio
    ratio = sensitivity.DEFAULT_RATIO
    assert w.sum() == pytest.approx(1.0) and w.max() / w.min() == pytest.approx(ratio)
    assert int(np.argmax(w)) == int(np.argmax(kl)) and int(np.argmin(w)) == int(np.argmin(kl))
    # plain JSON for any consumer: the weights are there without kvtransport
    assert np.allclose(json.loads(out.read_text())["layer_weights"], w)


@pytest.mark.model
def test_packaged_profile_of_the_default_model(smollm):
    prof = sensitivity.default_profile(smollm.model_id)
    assert prof is not None, "kvtransport/data lacks the default model's profile"
    assert prof.num_layers == smollm.num_layers
    assert all(x > 0 for x in prof.kl)
    assert prof.command.startswith("kvtransport profile")
    assert prof.calibration["samples"] >= 8
    assert np.allclose(prof.layer_weights, prof.weights(prof.weight_ratio))
    assert sensitivity.default_profile("no-such-model") is None


def test_bad_profile_files_are_user_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        sensitivity.load_profile(bad)
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(UserError, match="not a kvtransport sensitivity profile"):
        sensitivity.load_profile(bad)
    bad.write_text(
        json.dumps(
            {
                "format": sensitivity.FORMAT,
                "model_id": "m",
                "kl": [1, -1],
                "kl_std": [0, 0],
                "noise_scale": 1.0,
            }
        )
    )
    with pytest.raises(UserError, match="non-negative"):
        sensitivity.load_profile(bad)


def test_profile_command_rejects_bad_arguments_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "kvtransport", "profile", "--samples", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "--samples must be at least 1" in out.stderr
