"""The small version of scripts/eval_retention.py: utility order must beat random order.

Real model, held-out prompts (one per task family), a quarter and half of the blocks kept,
missing blocks masked per layer, layer weights from the packaged sensitivity profile
(without them the order is much weaker: see the uniform ablation in the report). The
margin is one a random order does not reach: it keeps as many blocks, but the wrong ones.
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "eval_retention.py"


def _script():
    spec = importlib.util.spec_from_file_location("eval_retention", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_utility_order_beats_random_order(smollm):
    from kvtransport.model import tasks, utility

    ev = _script()
    model, tok = smollm
    weights = utility.default_layer_weights(smollm.model_id, smollm.num_layers)
    assert weights is not None, "the model's packaged sensitivity profile is missing"
    samples = tasks.suite(tok, n=4, target_tokens=260, seed=ev.HELD_OUT_SEED + 500)
    fractions = (0.25, 0.5)
    records = [
        ev.measure_prompt(
            model,
            tok,
            s,
            fractions=fractions,
            orders=("utility", "random"),
            random_seeds=2,
            ref_tokens=24,
            layer_weights=weights,
        )
        for s in samples
    ]
    summary = ev.summarize(records, fractions, ("utility", "random"))
    gap = np.mean([summary[f"utility-random@{f}"]["mean"] for f in fractions])
    util = np.mean([summary[f"utility@{f}"]["mean"] for f in fractions])
    rand = np.mean([summary[f"random@{f}"]["mean"] for f in fractions])
    print(f"utility {util:.3f} random {rand:.3f} gap {gap:+.3f}")
    assert gap >= 0.2, summary
    # and not thanks to one lucky prompt
    wins = sum(r["results"]["utility@0.25"] > r["results"]["random@0.25"] for r in records)
    assert wins >= 3, records
