"""A model path that is neither on disk nor loadable from the hub fails in seconds, naming how to build the demo."""


from __future__ import annotations

import time

import pytest

from rlflow.config_error import ConfigError
from rlflow.models import model_path
from rlflow.models.model_path import check_model_path, looks_local


@pytest.fixture
def no_hub(monkeypatch):
    """The hub cannot be reached (as on this machine), whatever the network of the test machine."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(model_path, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setattr(model_path, "in_hf_cache", lambda repo_id: False)


def test_local_looking_paths():
    assert looks_local("/abs/model") and looks_local("./model") and looks_local("~/model") and looks_local("a/b/c")
    assert looks_local("model")  # no slash: not an org/name hub id
    assert not looks_local("Qwen/Qwen3-8B")


def test_first_component_on_disk_means_local_without_asking_the_hub(tmp_path, monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("a local path must not probe the hub")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.setattr(model_path, "hub_reachable", no_probe)
    with pytest.raises(ConfigError, match=r"model.model_path 'checkpoints/tiny-qwen3' does not exist; build it with "
                                          r"'python tools/make_tiny_model.py --out checkpoints/tiny-qwen3"):
        check_model_path("checkpoints/tiny-qwen3", "model.model_path")


def test_offline_hub_id_not_in_cache_is_an_error(monkeypatch, no_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        check_model_path("Qwen/Qwen3-8B", "model.model_path")


def test_hub_id_still_goes_to_from_pretrained_when_the_hub_answers(monkeypatch, no_hub):
    import transformers

    from rlflow.models.loading import load_causal_lm

    monkeypatch.setattr(model_path, "hub_reachable", lambda *a, **k: True)
    calls = []
    # the config the hub would answer with (a real request would spend ~20 s in retries on a machine without it)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda path, **kw: calls.append(("config", path)) or transformers.Qwen3Config())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda path, **kw: calls.append(path))
    load_causal_lm("Qwen/Qwen3-8B")
    assert calls == [("config", "Qwen/Qwen3-8B"), "Qwen/Qwen3-8B"]


def test_cached_hub_id_needs_no_network(monkeypatch, no_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(model_path, "in_hf_cache", lambda repo_id: repo_id == "Qwen/Qwen3-8B")
    check_model_path("Qwen/Qwen3-8B", "model.model_path")


def test_hub_probe_gives_up_within_its_timeout():
    model_path.hub_reachable.cache_clear()
    start = time.perf_counter()
    assert model_path.hub_reachable("https://rlflow-unreachable.invalid:1", timeout=0.5) is False
    assert time.perf_counter() - start < 2.0



@pytest.mark.parametrize("path", ["/data/my-model", "./models/qwen", "~/my/model"])
def test_a_missing_model_of_the_users_own_is_not_sent_to_the_demo_builds(path):
    with pytest.raises(ConfigError) as err:
        check_model_path(path, "model.model_path")
    assert "tools/" not in str(err.value) and "Hugging Face model directory" in str(err.value)


def test_a_folder_or_file_that_is_not_a_model_is_named_before_transformers_reads_it(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"model.model_path '.*data' has no config.json: not a Hugging Face model "
                                          r"directory$"):
        check_model_path(str(tmp_path / "data"), "model.model_path")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model.reference.path '.*adapter' has no config.json: a PEFT adapter; "
                                          r"give its base model here"):
        check_model_path(str(tmp_path / "adapter"), "model.reference.path")
    with pytest.raises(ConfigError, match=r"'.*train.jsonl' is a file; point it at the model's directory"):
        check_model_path(str(tmp_path / "data" / "train.jsonl"), "model.model_path")
    (tmp_path / "data" / "config.json").write_text("{}")
    check_model_path(str(tmp_path / "data"), "model.model_path")  # a model directory passes
