"""A bad setting (unknown key, wrong type) in a config file or on the command line is one ``rlflow: error:`` line
naming the file and line (or the command line), the full key, and for an unknown key the closest known one."""

from __future__ import annotations

import pytest

from rlflow.cli import main
from rlflow.config_parse_errors import key_line, parse_error_line

DEMO = "configs/demo_cpu.yaml"


def run(capsys, *extra: str) -> tuple[int, list[str]]:
    code = main(["fit", "--config", DEMO, *extra])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip() and not line.startswith(("Seed set", "(set "))]


def built(tiny_model) -> list[str]:
    """The test session's tiny model and data in place of the demo's ``checkpoints/`` (a clean checkout has none):
    a setting that parses and is refused later must meet its own check, not the missing model's. A run that is not
    refused writes its files beside the model, not into the repository."""
    data = tiny_model.parent / "data"
    return [f"--model.model_path={tiny_model}", f"--data.train_data_path={data / 'train.jsonl'}",
            f"--data.eval_data_path={data / 'val.jsonl'}", "--trainer.logger=false",
            f"--trainer.default_root_dir={tiny_model.parent / 'runs'}"]


def test_a_bad_value_on_the_command_line_is_one_line(capsys):
    code, lines = run(capsys, "--data.sampling.max_tokens=abc")
    assert code == 1
    assert lines == ["rlflow: error: command line: data.sampling.max_tokens: expected int, got abc"]


BOTH_PLACES = {
    "a bad value of an optional setting names what it takes": (
        ["--data.judging.timeout", "abc"], "data.judging.timeout: expected float or null, got abc",
        "data:\n  judging:\n    max_failure_rate: lots\n",
        "data.judging.max_failure_rate: expected float or null, got lots"),
    "an unknown field of a settings dataclass is named with a guess": (
        ["--model.lora", "{rr: 8}"], "model.lora.rr is not a setting; did you mean model.lora.r?",
        "model:\n  lora:\n    rr: 8\n", "model.lora.rr is not a setting; did you mean model.lora.r?"),
}


@pytest.mark.parametrize("case", BOTH_PLACES)
def test_a_bad_setting_is_one_line_on_the_command_line_and_in_a_file(tmp_path, capsys, case):
    argv, on_command_line, text, in_file = BOTH_PLACES[case]
    code, lines = run(capsys, *argv)
    assert code == 1
    assert lines == [f"rlflow: error: command line: {on_command_line}"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    code, lines = run(capsys, "--config", str(bad))
    assert lines == [f"rlflow: error: {bad}, line 3: {in_file}"]


def test_a_bad_plugin_argument_names_its_init_args_key(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  loss:\n    class_path: bnpo\n    init_args:\n      kl_coef: x\n")
    message = ("Parser key \"model.loss\":\n  Does not validate against any of the Union subtypes\n  Errors:\n"
               "    - Expected a <class 'str'>\n    - Problem with given class_path 'rlflow.losses.clipped.BNPOLoss':\n"
               "        Parser key \"kl_coef\":\n          Expected a <class 'float'>. Got value: x\n")
    line = parse_error_line(message, ["--config", str(config)], [])
    assert line == f"{config}, line 5: model.loss.init_args.kl_coef: expected float, got x"


def test_a_key_far_from_every_setting_gets_no_guess():
    line = parse_error_line("Subcommand 'fit' does not accept option 'zzz.qqq'", [], ["data.sampling.max_tokens"])
    assert line == "zzz.qqq is not a setting (`rlflow fit --help` lists the settings)"


def test_key_line_follows_nesting_and_the_fit_level(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("fit:\n  data:\n    a: 1\n    sampling:\n      max_tokens: 3\n")
    assert key_line(str(path), "data.sampling.max_tokens") == 5
    assert key_line(str(path), "data.a") == 3
    assert key_line(str(path), "data.b") is None


def test_an_unknown_plugin_argument_is_named_where_it_is_set(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("model:\n  loss:\n    class_path: bnpo\n    init_args:\n      epsilon_low: 0.2\n"
                   "      epsilon_hgh: 0.3\n")
    code, lines = run(capsys, "--config", str(bad))
    assert code == 1
    assert lines == [f"rlflow: error: {bad}, line 6: model.loss.init_args.epsilon_hgh is not a setting; "
                     "did you mean model.loss.init_args.epsilon_high?"]
    code, lines = run(capsys, "--model.loss.init_args.epsilon_hgh", "0.3")  # the demo config sets model.loss
    assert lines == ["rlflow: error: command line: model.loss.init_args.epsilon_hgh is not a setting; "
                     "did you mean model.loss.init_args.epsilon_high?"]


def test_a_bad_value_of_a_settings_dataclass_field_has_no_init_args(capsys):
    code, lines = run(capsys, "--model.lora.r", "abc")
    assert code == 1
    assert lines == ["rlflow: error: command line: model.lora.r: expected int, got abc"]


def test_a_nested_key_is_not_expected_message_names_the_full_key():
    message = ("Parser key \"model.loss\":\n  Does not validate against any of the Union subtypes\n  Errors:\n"
               "    - Expected a <class 'str'>\n    - Problem with given class_path 'rlflow.losses.clipped.BNPOLoss':\n"
               "        Key 'epsilon_hgh' is not expected\n")
    line = parse_error_line(message, ["fit", "--model.loss.init_args.epsilon_hgh", "0.3"], [])
    assert line == ("command line: model.loss.init_args.epsilon_hgh is not a setting; "
                    "did you mean model.loss.init_args.epsilon_high?")


FILE_CASES = {
    "a bad key names the closest one": (
        "model:\n  optim:\n    lr: 1e-4\n  update:\n    packng: false\n",
        "{bad}, line 5: model.update.packng is not a setting; did you mean model.update.packing?"),
    "an unknown key of a group keeps its group": (
        "data:\n  sampling:\n    max_tokenz: 3\n",
        "{bad}, line 3: data.sampling.max_tokenz is not a setting; did you mean data.sampling.max_tokens?"),
    "an option outside its choices lists them": (
        "data:\n  rollout:\n    class_path: engine\n    init_args: {dtype: cube}\n",
        "{bad}, line 4: data.rollout.init_args.dtype: expected one of model, float32, bfloat16, float16, auto, got "
        "cube"),
    "an argument without a default that is not given is named": (
        'data:\n  judging:\n    judgers:\n      "*": {class_path: remote}\n',
        "{bad}, line 3: data.judging.judgers: rlflow.judgers.remote.RemoteJudger needs init_args.url"),
    "a class_path that does not import says why": (
        "model:\n  loss:\n    class_path: nosuchpkg.Loss\n",
        "{bad}, line 2: model.loss: class_path 'nosuchpkg.Loss': No module named 'nosuchpkg'"),
    "a judger's own refusal in a list is its message alone": (
        'data:\n  judging:\n    judgers:\n      "*": [gsm8k, {class_path: remote, init_args: {url: "http://x", '
        'max_retries: -1}}]\n',
        "data.judging.judgers (rlflow.judgers.remote.RemoteJudger): remote judger: timeout > 0, max_retries >= 0, "
        "backoff >= 0 and max_concurrency >= 1 are required"),
    "a judger's argument inside routes and lists is found on its own line": (
        'data:\n  judging:\n    judgers:\n      "*":\n        - gsm8k\n        - class_path: overlong\n'
        "          init_args:\n            penalty_factor: lots\n",
        "{bad}, line 8: data.judging.judgers.init_args.penalty_factor: expected float, got lots"),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_a_bad_setting_in_a_config_file_is_one_line_saying_where_and_what_is_wrong(tmp_path, capsys, tiny_model, case):
    text, expected = FILE_CASES[case]
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    code, lines = run(capsys, "--config", str(bad), "--trainer.max_steps=1", *built(tiny_model))
    assert code == 1
    assert lines == [f"rlflow: error: {expected.format(bad=bad)}"]


def test_a_judger_mapping_on_the_command_line_names_the_refused_judger(capsys, tiny_model):
    cases = [
        ('{"*": {"class_path": "remote", "init_args": {"url": "http://x", "timeout": "abc"}}}',
         "command line: data.judging.judgers['*'].init_args.timeout: expected float, got abc"),
        ('{"a": "gsm8k", "*": [{"class_path": "remote", "init_args": {"urll": "http://x"}}]}',
         "command line: data.judging.judgers['*'].init_args.urll is not a setting; did you mean "
         "data.judging.judgers['*'].init_args.url?"),
    ]
    for value, expected in cases:
        code, lines = run(capsys, "--data.judging.judgers", value, "--trainer.max_steps=1", *built(tiny_model))
        assert code == 1
        assert lines == [f"rlflow: error: {expected}"]


def test_validate_without_a_config_says_what_it_needs(capsys):
    assert main(["validate", "--ckpt_path", "runs/demo/version_0/checkpoints/last.ckpt"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: error:")]
    assert lines == ["rlflow: error: model.model_path: expected str, got None; pass the run's --config (its "
                     "config.yaml) or --model.model_path"]


REFUSED_WHEN_BUILT = {
    "--samples.num_samples=0": "samples.every_n_steps must be >= 0 and samples.num_samples >= 1, got 10, 0",
    "--no_signal.patience=-1": "no_signal.patience must be >= 0 (0 disables it), got -1",
    "--data.judging.weights={nope: 1}": "data.judging.weights names judger 'nope', which is not configured; "
                                        "judgers: ['gsm8k']",
    "--data.judging.judgers={}": "data.judging.judgers is empty: map each data_source to a judger",
    "--data.train_data_path=[{path: a.jsonl, weight: 0}]": "data.train_data_path[0].weight must be a positive "
                                                           "number, got 0",
    "--data.prompts.template={nope}": "data.prompts.template '{nope}' has no '{prompt}' placeholder",
    "--model.lora={r: 0}": "model.lora.r must be an integer >= 1, got 0",
    "--model.model_path=/etc": "model.model_path '/etc' has no config.json: not a Hugging Face model directory",
    "--data.judging.judgers={'*': 'math:pi'}": "data.judging.judgers: 'math:pi' is a float, not a judger",
    "--trainer.check_val_every_n_epoch=0": "trainer.check_val_every_n_epoch must be >= 1 (or null), got 0",
    # Lightning's own refusals of Trainer and callback arguments, its message as the line
    "--trainer.max_steps=-5": "`max_steps` must be a non-negative integer or -1 (infinite steps). You passed in -5.",
    "--trainer.strategy=nonsense": "You selected an invalid strategy name: `strategy='nonsense'`.",
    "--checkpoint.save_top_k=-2": "Invalid value for save_top_k=-2. Must be >= -1",
}


@pytest.mark.parametrize("option", REFUSED_WHEN_BUILT)
def test_a_value_refused_when_its_object_is_built_is_one_line(capsys, tiny_model, option):
    """Values that parse but that the callback, judger panel, data source or Lightning refuses when built: one line,
    not a traceback."""
    code, lines = run(capsys, *built(tiny_model), "--trainer.max_steps=1", option)
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith(f"rlflow: error: {REFUSED_WHEN_BUILT[option]}"), lines


def test_a_config_file_that_is_missing_not_yaml_or_not_a_mapping_is_named(tmp_path, capsys):
    broken, listed, text = tmp_path / "broken.yaml", tmp_path / "list.yaml", tmp_path / "notes.txt"
    broken.write_text("data:\n  sampling: [1\n")
    listed.write_text("- 1\n- 2\n")
    text.write_text("just some words\n")
    cases = {
        str(tmp_path / "missing.yaml"): f"--config {tmp_path / 'missing.yaml'}: no such file",
        str(broken): f"{broken}, line 3: not YAML (expected ',' or ']', but got '<stream end>'); a config is a YAML "
                     "mapping of settings",
        str(listed): f"{listed}: not a mapping of settings (the file holds a YAML list)",
        str(text): f"{text}: not a mapping of settings (the file holds a YAML str)",
    }
    for path, expected in cases.items():
        code = main(["fit", "--config", path])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: ")]
        assert code == 1 and lines == [f"rlflow: error: {expected}"]


def test_validate_without_eval_data_says_so(capsys, tiny_model):
    code = main(["validate", "--config", DEMO, *built(tiny_model), "--data.eval_data_path=null"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: ")]
    assert code == 1 and lines == ["rlflow: error: rlflow validate evaluates on data.eval_data_path, which is not "
                                   "set; give it the prompts to evaluate on"]
