"""``rlflow fit --data.advantage=gdpo`` with two weighted judgers: the advantages use each judger's own rewards."""

from __future__ import annotations

import pytest
import torch

from tests.unit.advantages.test_advantages import ref_gdpo


@pytest.mark.slow
def test_gdpo_through_fit_uses_each_judgers_rewards_and_weights(tiny_model, tiny_data, tmp_path, monkeypatch):
    """``rlflow fit --data.advantage=gdpo`` with two judgers (a TRL reward function and gsm8k) and weights: the
    advantages it trains on equal the loop reference computed from the judgers' own rewards; with DAPO's dynamic
    sampling it is a config error."""
    import json

    import rlflow.data.experience_maker as dm_module
    from rlflow.cli import cli_main
    from rlflow.config_error import ConfigError
    from tests.helpers.fit import fit_args

    seen = []
    original = dm_module.estimate_global

    def recording(estimator, rewards, k, lengths=None, components=None):
        out = original(estimator, rewards, k, lengths=lengths, components=components)
        seen.append((components, out))
        return out

    monkeypatch.setattr(dm_module, "estimate_global", recording)
    judgers = {"*": [{"class_path": "function", "init_args": {"path": "tests.helpers.reward_helpers:reward_len"}},
                     "gsm8k"]}
    args = fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={json.dumps(judgers)}",
                    '--data.judging.weights={"reward_len": 0.5, "gsm8k": 2.0}', "--data.advantage=gdpo", steps=2)
    cli = cli_main(args)
    assert cli.trainer.global_step == 2 and len(seen) == 2
    for (comp, weights), out in seen:
        assert weights.tolist() == [2.0, 0.5]  # sorted by judger name: gsm8k, reward_len
        rows = [[None if v != v else v for v in row] for row in comp.tolist()]
        torch.testing.assert_close(out, torch.tensor(ref_gdpo(rows, weights.tolist(), 4)), rtol=1e-5, atol=1e-5)
        assert len({round(v, 3) for v in comp[:, 1].tolist()}) > 1  # reward_len varies: a real signal
    with pytest.raises(ConfigError, match="use one or the other"):
        cli_main(
            fit_args(tiny_model, tiny_data, tmp_path, "--data.advantage=gdpo", "--data.filtering.dynamic_sampling=true")
        )
