"""The entry-point registry: discovery, loading, errors, building from config values, and ``rlflow plugins``."""

from __future__ import annotations

from importlib.metadata import version
from types import SimpleNamespace

import pytest

from rlflow import plugins_cmd, registry
from rlflow.judgers.gsm8k import GSM8KJudger

GROUP = "rlflow.judgers"


class FakeDistribution:
    """Stands in for ``importlib.metadata.Distribution``: a name and a version."""

    def __init__(self, name: str, version: str) -> None:
        self.metadata = {"Name": name}
        self.version = version


class FakeEntryPoint:
    """Stands in for ``importlib.metadata.EntryPoint``; ``target`` is what ``load()`` returns or raises."""

    def __init__(self, name: str, value: str, dist: FakeDistribution, target=None) -> None:
        self.name, self.value, self.group, self.dist = name, value, GROUP, dist
        self.target = target
        self.loads = 0

    def load(self):
        self.loads += 1
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.clear_cache()
    yield
    registry.clear_cache()  # later tests see the real, installed entry points again


def fake_group(monkeypatch, *eps: FakeEntryPoint) -> list[str]:
    """Make the registry see only ``eps``; returns a list that records every entry-point scan."""
    scans: list[str] = []

    def entry_points(group=None):
        if group is None:  # every group (registry.misplaced)
            return SimpleNamespace(groups={ep.group for ep in eps})
        scans.append(group)
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(registry, "entry_points", entry_points)
    return scans


def test_builtins_come_from_rlflows_own_entry_points():
    plugins = registry.discover(GROUP)
    assert {"gsm8k", "math", "think_format", "overlong", "remote", "function"} <= set(plugins)
    assert plugins["gsm8k"].distribution == "rlflow" and plugins["gsm8k"].version
    assert registry.load(GROUP, "gsm8k") is GSM8KJudger
    assert "grpo" in registry.available("rlflow.losses") and "hf" in registry.available("rlflow.rollout")


def test_unknown_short_name_lists_the_available_ones():
    with pytest.raises(registry.PluginError) as info:
        registry.build(GROUP, "gsm9k")
    message = str(info.value)
    assert "'gsm9k'" in message
    for name in ("gsm8k", "math", "think_format", "overlong", "remote", "function"):
        assert name in message
    with pytest.raises(registry.PluginError, match="available: .*gsm8k"):
        registry.build(GROUP, {"class_path": "nope", "init_args": {}})
    with pytest.raises(registry.PluginError, match="unknown plugin group 'rlflow.judger'"):
        registry.discover("rlflow.judger")


def test_broken_plugin_names_its_distribution_and_chains_the_exception(monkeypatch):
    cause = ModuleNotFoundError("No module named 'torchx'")
    dist = FakeDistribution("broken-dist", "1.2.3")
    fake_group(monkeypatch, FakeEntryPoint("broken", "broken_pkg.judge:Judge", dist, cause))
    with pytest.raises(registry.PluginError) as info:
        registry.build(GROUP, "broken")
    message = str(info.value)
    assert "broken-dist 1.2.3" in message and "broken_pkg.judge:Judge" in message and "torchx" in message
    assert info.value.__cause__ is cause


def test_two_distributions_claiming_one_name_make_that_name_an_error_naming_both(monkeypatch):
    fake_group(
        monkeypatch,
        FakeEntryPoint("countdown", "pkg_a.cd:Judge", FakeDistribution("pkg-a", "1.0"), object),
        FakeEntryPoint("countdown", "pkg_b.cd:Judge", FakeDistribution("pkg-b", "2.0"), object),
        FakeEntryPoint("exact", "pkg_c:Exact", FakeDistribution("pkg-c", "1.0"), int),
    )
    with pytest.raises(registry.PluginError) as info:
        registry.load(GROUP, "countdown")
    assert "pkg-a 1.0" in str(info.value) and "pkg-b 2.0" in str(info.value) and "'countdown'" in str(info.value)
    assert registry.load(GROUP, "exact") is int  # the group's other plugins are not affected
    assert registry.available(GROUP) == ["countdown", "exact"]


def test_a_plugin_in_a_misspelt_group_is_pointed_at(monkeypatch):
    wrong = FakeEntryPoint("wg", "pkg:J", FakeDistribution("pkg-wg", "1.0"), object)
    wrong.group = "rlflow.judger"
    fake_group(monkeypatch, wrong)
    with pytest.raises(registry.PluginError, match="pkg-wg registers 'wg' in the entry-point group 'rlflow.judger', "
                                                   f"which rlflow does not read: the group is '{GROUP}'"):
        registry.load(GROUP, "wg")


def test_one_distribution_seen_twice_is_not_a_conflict(monkeypatch):
    dist = FakeDistribution("pkg-a", "1.0")
    fake_group(monkeypatch, FakeEntryPoint("x", "pkg_a:X", dist, object), FakeEntryPoint("x", "pkg_a:X", dist, object))
    assert registry.available(GROUP) == ["x"]


def test_groups_are_scanned_and_plugins_imported_once_per_process(monkeypatch):
    ep = FakeEntryPoint("counted", "pkg:Judge", FakeDistribution("pkg", "0.1"), GSM8KJudger)
    scans = fake_group(monkeypatch, ep)
    first = registry.build(GROUP, "counted")
    second = registry.build(GROUP, {"class_path": "counted", "init_args": {"score": 2.0}})
    registry.available(GROUP)
    assert scans == [GROUP] and ep.loads == 1
    assert isinstance(first, GSM8KJudger) and second.correct_score == 2.0 and first is not second


def test_build_by_name_mapping_import_path_and_ready_object():
    judger = registry.build(GROUP, {"class_path": "gsm8k", "init_args": {"format_score": 0.1}})
    assert isinstance(judger, GSM8KJudger) and judger.format_score == 0.1
    by_path = registry.build(GROUP, {"class_path": "rlflow.judgers.gsm8k:GSM8KJudger", "init_args": {"score": 3}})
    assert isinstance(by_path, GSM8KJudger) and by_path.correct_score == 3.0
    dotted = registry.build(GROUP, "rlflow.judgers.gsm8k.GSM8KJudger")
    assert isinstance(dotted, GSM8KJudger)
    fn = registry.build(GROUP, "tests.helpers.reward_helpers:reward_len")  # a plain function comes back as is
    assert fn.__name__ == "reward_len"
    ready = GSM8KJudger()
    assert registry.build(GROUP, ready) is ready
    with pytest.raises(registry.PluginError, match="no attribute 'missing'"):
        registry.build(GROUP, "tests.helpers.reward_helpers:missing")
    with pytest.raises(registry.PluginError, match="could not import module 'no_such_module'"):
        registry.build(GROUP, "no_such_module:fn")
    with pytest.raises(registry.PluginError, match="takes no init_args"):
        registry.build(GROUP, {"class_path": "tests.helpers.reward_helpers:reward_len", "init_args": {"a": 1}})
    with pytest.raises(registry.PluginError, match="needs 'class_path'"):
        registry.build(GROUP, {"init_args": {}})
    with pytest.raises(registry.PluginError, match="could not build"):
        registry.build(GROUP, {"class_path": "gsm8k", "init_args": {"no_such_arg": 1}})


def test_defaults_fill_only_arguments_the_class_accepts():
    judger = registry.build(GROUP, "overlong", max_tokens=100, unrelated=1)
    assert judger.max_tokens == 100 and judger.buffer_tokens == 20
    explicit = registry.build(GROUP, {"class_path": "overlong", "init_args": {"max_tokens": 50}}, max_tokens=100)
    assert explicit.max_tokens == 50  # the config wins over the default


def test_rlflow_plugins_lists_name_distribution_and_version(capsys):
    assert plugins_cmd.main(["--group", GROUP, "--check"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith("gsm8k "))
    assert f"rlflow {version('rlflow')}" in line and "rlflow.judgers.gsm8k:GSM8KJudger" in line and line.endswith("ok")
    assert "rlflow.losses" not in out


def test_rlflow_plugins_reports_conflicts_and_broken_plugins(monkeypatch, capsys):
    dist = FakeDistribution("bad-dist", "0.0.1")
    fake_group(monkeypatch, FakeEntryPoint("bad", "bad_pkg:J", dist, ImportError("boom")))
    assert plugins_cmd.main(["--group", GROUP, "--check"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN" in out and "bad-dist 0.0.1" in out and "boom" in out
    registry.clear_cache()
    fake_group(
        monkeypatch,
        FakeEntryPoint("x", "a:X", FakeDistribution("dist-a", "1"), object),
        FakeEntryPoint("x", "b:X", FakeDistribution("dist-b", "1"), object),
    )
    assert plugins_cmd.main(["--group", GROUP]) == 1
    assert "CONFLICT: two distributions claim" in capsys.readouterr().out


def test_rlflow_plugins_is_dispatched_by_the_rlflow_command(capsys):
    from rlflow.entry import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for group in registry.GROUPS:
        assert f"{group}:" in out
    assert "think_format" in out and f"rlflow {version('rlflow')}" in out


# ------------------------------------------------------------------ typed plugin arguments (jsonargparse)
def typed_parser(key: str, base: type):
    """A parser with one plugin argument typed as rlflow's are, with registry short names resolvable."""
    from jsonargparse import ArgumentParser

    registry.install_jsonargparse_resolver()
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument(f"--{key}", type=str | base)
    return parser


def test_class_path_short_name_resolves_and_init_args_are_validated():
    from rlflow.losses.base import PolicyLoss
    from rlflow.losses.clipped import GRPOLoss

    parser = typed_parser("loss", PolicyLoss)
    cfg = parser.parse_args(["--loss", '{"class_path": "grpo", "init_args": {"kl_coef": 0.01}}'])
    assert cfg.loss.class_path == "rlflow.losses.clipped.GRPOLoss"
    assert cfg.loss.init_args.kl_coef == 0.01 and cfg.loss.init_args.epsilon_low == 0.2  # the class's options
    loss = parser.instantiate_classes(cfg).loss
    assert isinstance(loss, GRPOLoss) and loss.kl_coef == 0.01
    assert registry.build("rlflow.losses", loss) is loss  # what jsonargparse built is used as is
    assert parser.parse_args(["--loss", "bnpo"]).loss == "bnpo"  # a plain name stays a string for build()
    with pytest.raises(Exception, match="kl_coeff"):  # a misspelt option is caught while parsing
        parser.parse_object({"loss": {"class_path": "grpo", "init_args": {"kl_coeff": 0.01}}})


def test_unknown_class_path_gives_the_registrys_error():
    from rlflow.rollout.base import RolloutBackend

    parser = typed_parser("rollout", RolloutBackend)
    with pytest.raises(Exception, match=r"unknown rlflow.rollout plugin 'nope'; available: engine, hf, lmdeploy"):
        parser.parse_object({"rollout": {"class_path": "nope"}})


def test_third_party_entry_point_resolves_as_class_path():
    pytest.importorskip("rlflow_judger_example")
    from rlflow.judgers.base import Judger

    parser = typed_parser("judger", Judger)
    cfg = parser.parse_object({"judger": {"class_path": "countdown", "init_args": {"format_score": 0.0}}})
    assert cfg.judger.class_path == "rlflow_judger_example.countdown.CountdownJudger"
    assert type(parser.instantiate_classes(cfg).judger).__name__ == "CountdownJudger"


def test_a_class_name_still_resolves_and_the_resolver_installs_once():
    from jsonargparse import _typehints

    from rlflow.advantages.base import AdvantageEstimator

    parser = typed_parser("advantage", AdvantageEstimator)
    cfg = parser.parse_object({"advantage": {"class_path": "RLOOAdvantage"}})
    assert cfg.advantage.class_path.endswith(".RLOOAdvantage")
    resolver = _typehints.resolve_class_path_by_name
    registry.install_jsonargparse_resolver()
    assert _typehints.resolve_class_path_by_name is resolver and resolver.rlflow_registry


def test_mapping_given_as_text_builds_like_the_mapping():
    judger = registry.build(GROUP, '{class_path: gsm8k, init_args: {format_score: 0.1}}')
    assert isinstance(judger, GSM8KJudger) and judger.format_score == 0.1
    with pytest.raises(registry.PluginError, match="unknown rlflow.judgers plugin 'nope'"):
        registry.build(GROUP, "{class_path: nope}")


def test_init_defaults_follow_kwargs_up_the_mro_and_settings_fill_only_unset_args():
    from rlflow.losses.clipped import GSPOLoss

    params, takes_any = registry.init_defaults(GSPOLoss)
    assert params["importance_sampling_level"] == "sequence" and params["delta"] is None
    assert params["kl_coef"] == 0.0 and params["epsilon_high"] is None and not takes_any
    init_args = {"kl_coef": 0.0, "epsilon_low": 0.3}
    conflicts = registry.apply_settings(GSPOLoss, init_args, {"kl_coef": 0.01, "epsilon_low": 0.2, "kl_type": None,
                                                             "unknown": 1})
    assert init_args == {"kl_coef": 0.01, "epsilon_low": 0.3}  # 0.0 is the default: unset; 0.3 was set
    assert conflicts == {"epsilon_low": (0.3, 0.2)}


def test_a_module_exiting_as_it_imports_is_a_plugin_error_naming_it(tmp_path, monkeypatch):
    source = "import sys\nsys.exit(9)\n\ndef reward(completions, **kw):\n    return []\n"
    (tmp_path / "exits_on_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(registry.PluginError, match="could not import module 'exits_on_import'.*SystemExit: 9"):
        registry.import_path("exits_on_import:reward")


def test_rlflow_plugins_check_builds_a_tool_functions_schema(monkeypatch, capsys):
    def nodoc(x):
        return x

    def documented(x: int) -> int:
        """Doubles x.

        Args:
            x: a number
        """
        return 2 * x

    dist = FakeDistribution("tool-dist", "1")
    tools = [FakeEntryPoint("nodoc", "t:nodoc", dist, nodoc), FakeEntryPoint("documented", "t:documented", dist,
                                                                             documented)]
    for ep in tools:
        ep.group = "rlflow.tools"
    fake_group(monkeypatch, *tools)
    assert plugins_cmd.main(["--group", "rlflow.tools", "--check"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN: cannot build the JSON schema of tool 'nodoc'" in out
    assert "documented  tool-dist 1  (t:documented)  ok" in out
