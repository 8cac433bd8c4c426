"""The ``reward_model`` judger: scores match a plain forward pass, it works in the panel, errors name the cause."""


from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from rlflow import registry
from rlflow.judgers.reward_model import RewardModelError, RewardModelJudger
from rlflow.judgers.runner import JudgerRunner

RM = "rlflow.judgers.reward_model:RewardModelJudger"
PLAIN = ["What is 1 + 2?", "Hi", "A longer prompt, so the batch needs padding: 3 - 1 ="]
DONE = [" 3", " there, how are you doing today?", " 2"]
CHAT = [[{"role": "user", "content": p}] for p in PLAIN]


def save_reward_model(path: Path, num_labels: int = 1, chat_template: bool = True) -> Path:
    """A tiny random Qwen3 sequence classifier with the project's char tokenizer, saved to ``path``."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from rlflow.demo import tiny_model as tiny

    tokenizer = tiny.build_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=len(tokenizer), num_labels=num_labels, pad_token_id=tokenizer.pad_token_id,
                         **tiny.MODEL_KWARGS)
    Qwen3ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm") / "model")


def reference_scores(path: Path, texts: list[str]) -> list[float]:
    """Independently: one padded batch through the model, ``logits[:, 0]``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # the batch really is padded
    with torch.no_grad():
        return model(**batch).logits[:, 0].tolist()


def chat_text(prompt: str, completion: str) -> str:  # the tiny tokenizer's chat template, written out
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{completion}<|im_end|>\n"


def judger(path: Path, **init_args) -> RewardModelJudger:
    init_args = {"model_path": str(path), "device": "cpu", **init_args}
    return registry.build("rlflow.judgers", {"class_path": RM, "init_args": init_args})


def test_plain_and_chat_scores_match_a_plain_forward_for_any_batch_size(rm_path):
    plain = reference_scores(rm_path, [p + c for p, c in zip(PLAIN, DONE)])
    chat = reference_scores(rm_path, [chat_text(p, c) for p, c in zip(PLAIN, DONE)])
    assert len(set(plain)) == 3 and plain != pytest.approx(chat)  # distinct scores: a mix-up would show
    for batch_size in (1, 2, 3):
        rm = judger(rm_path, batch_size=batch_size)
        assert rm(PLAIN, DONE, None) == pytest.approx(plain, abs=1e-5)
        completions = [[{"role": "assistant", "content": c}] for c in DONE]
        assert rm(CHAT, completions, [[1]] * 3, data_source=["x"] * 3) == pytest.approx(chat, abs=1e-5)


def test_max_length_keeps_the_end_of_the_text(rm_path):
    texts = [p + c for p, c in zip(PLAIN, DONE)]  # 17, 34 and 54 characters (one token each)
    kept = reference_scores(rm_path, [t[-20:] for t in texts])
    assert kept[1:] != pytest.approx(reference_scores(rm_path, texts)[1:])  # truncating changes the two long ones
    assert judger(rm_path, max_length=20, batch_size=3)(PLAIN, DONE) == pytest.approx(kept, abs=1e-5)


def test_in_the_runner_with_routing_and_weights_and_after_pickling(rm_path):
    spec = {"class_path": RM, "init_args": {"model_path": str(rm_path), "device": "cpu", "batch_size": 2}}
    runner = JudgerRunner({"openai/gsm8k": ["gsm8k", spec], "other": "gsm8k"}, reward_weights={"reward_model": 0.5},
                          timeout=60)
    runner = pickle.loads(pickle.dumps(runner))  # the model is not pickled: it loads again on the first call
    completions = [[{"role": "assistant", "content": c}] for c in ["#### 3", "#### 5", "#### 2"]]
    result = runner.judge(CHAT, completions, [[1]] * 3, {"data_source": ["openai/gsm8k", "openai/gsm8k", "other"],
                                                          "ground_truth": ["3", "3", "2"]})
    scores = reference_scores(rm_path, [chat_text(p, c[0]["content"]) for p, c in zip(PLAIN[:2], completions)])
    assert result.per_judger["reward_model"] == pytest.approx([*scores, None], abs=1e-5)  # "other" is not routed to it
    assert result.rewards == pytest.approx([1.0 + 0.5 * scores[0], 0.5 * scores[1], 1.0], abs=1e-5)
    assert result.metrics["judger/failures"] == 0 and "rewards/reward_model/mean" in result.metrics


def test_config_errors_name_the_model_and_the_cause(rm_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/rm"):
        judger(tmp_path / "nowhere" / "rm")
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardModelError, match=r"two'.*num_labels=2"):
        judger(two)
    with pytest.raises(ValueError, match="dtype"):
        judger(rm_path, dtype="int8")
    with pytest.raises(ValueError, match="'gpu'"):
        judger(rm_path, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RewardModelError, match="CUDA"):
            judger(rm_path, device="cuda:1")
    plain_only = judger(save_reward_model(tmp_path / "plain", chat_template=False))
    assert len(plain_only(PLAIN, DONE)) == 3
    with pytest.raises(RewardModelError, match=r"plain'.*no chat template"):
        plain_only(CHAT, DONE)


def test_lazy_build_pad_token_from_eos_and_dtype(rm_path, tmp_path):
    from transformers import AutoTokenizer

    rm = judger(rm_path)
    assert rm.model is None and rm.name == "reward_model"
    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "tok")
    rm = judger(rm_path, tokenizer_path=str(tmp_path / "tok"), name="rm")
    rm.load()
    assert rm.tokenizer.pad_token == "<|im_end|>" and rm.model.config.pad_token_id == rm.tokenizer.eos_token_id
    assert rm.model.dtype == torch.float32 and rm.name == "rm"
    half = judger(rm_path, dtype="bfloat16")
    assert half(PLAIN, DONE) == pytest.approx(reference_scores(rm_path, [p + c for p, c in zip(PLAIN, DONE)]), abs=0.01)
    assert half.model.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_in_bfloat16_the_scores_are_close_to_float32_on_cpu(rm_path):
    rm = judger(rm_path, device="auto")
    scores = rm(PLAIN, DONE)
    assert rm.model.device.type == "cuda" and rm.model.dtype == torch.bfloat16
    assert scores == pytest.approx(reference_scores(rm_path, [p + c for p, c in zip(PLAIN, DONE)]), abs=0.01)


def test_in_the_panel_a_hanging_or_broken_reward_model_is_a_counted_failure(rm_path, tmp_path, caplog):
    """A reward model slower than ``data.judging.timeout`` and one whose weights cannot load each give None for
    their samples, are counted in ``judger/failures`` (the error naming the model and the cause), and the other
    judgers' rewards stand."""
    import shutil
    import threading
    import time

    broken = shutil.copytree(rm_path, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")

    def spec(path, name):
        return {"class_path": RM, "init_args": {"model_path": str(path), "device": "cpu", "name": name}}

    runner = JudgerRunner({"*": ["gsm8k", spec(rm_path, "slow_rm"), spec(broken, "broken_rm")]}, timeout=0.5)
    slow = runner.judgers["slow_rm"]
    slow.load()
    forward, finished = slow.model.forward, threading.Event()

    def slow_forward(*args, **kwargs):
        time.sleep(1.5)
        try:
            return forward(*args, **kwargs)
        finally:
            finished.set()

    slow.model.forward = slow_forward
    completions = [[{"role": "assistant", "content": c}] for c in ["#### 3", "#### 5"]]
    result = runner.judge(CHAT[:2], completions, [[1]] * 2, {"data_source": ["x", "x"], "ground_truth": ["3", "3"]})
    assert result.per_judger["slow_rm"] == [None, None] and result.per_judger["broken_rm"] == [None, None]
    assert result.per_judger["gsm8k"] == [1.0, 0.0] and result.rewards == [1.0, 0.0]
    assert result.metrics["judger/failures"] == 4
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "data.judging.timeout=0.5" in messages
    assert f"reward model {str(broken)!r}: cannot load it as a sequence classifier" in messages
    assert finished.wait(10)  # the abandoned call ends on its own (not left running into the next test)

