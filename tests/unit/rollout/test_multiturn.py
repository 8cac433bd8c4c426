"""Multi-turn rollouts: the loop (tool calls, failures, max_turns, the token budget), token-in/token-out exactness
with Qwen3's non-append-only template, on scripted and real (``hf``, ``engine``) backends, and log-probs and loss
masks of the trained sequence against a plain full forward."""

from __future__ import annotations

import pytest
import torch

from rlflow.data.dataset import PromptRecord
from rlflow.data.experience import Experience, collate
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.multiturn import MultiTurn, multiturn_metrics
from rlflow.tools.base import load_tools
from rlflow.training.logprobs import completion_logprobs
from rlflow.training.packing import collate_packed, packed_completion_logprobs
from tests.helpers.multiturn_helpers import (
    RecordingBackend,
    ScriptedBackend,
    add,
    boom,
    hang,
    qwen3_char_tokenizer,
    tiny_model,
)

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return qwen3_char_tokenizer()


def record(tok, question: str, tools=None, **columns) -> PromptRecord:
    prompt = [{"role": "user", "content": question}]
    kwargs = {"tools": [t.schema for t in tools.values()]} if tools else {}
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kwargs)
    return PromptRecord(prompt, dict(columns), "test.jsonl:1", tok.encode(text, add_special_tokens=False), text)


def params(tok, max_tokens=400, temperature=1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, stop_token_ids=[tok.eos_token_id])


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


CALL_ADD = ('<think>\nI should add.\n</think>\n\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>')


def test_tool_turn_is_token_exact_and_masked(tok):
    tools = load_tools([add])
    mt = MultiTurn(tok, tools, max_turns=4)
    backend = ScriptedBackend(tok, [[CALL_ADD + END, "The answer is 42." + END],
                                    ["<think>\nGot 42.\n</think>\n\nThe answer is 42." + END]])
    rec = record(tok, "What is 12+30?", tools)
    (first, second), = mt.generate(backend, [rec], params(tok), n=2)
    out1, out2 = backend.outputs[0][0], backend.outputs[1][0]
    # the tool message as Qwen3's template writes it after an assistant turn, worked out by hand: the rest of the
    # end of turn ("\n" after the sampled <|im_end|>), the tool response as a user turn, the generation prompt
    inserted = ids(tok, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert backend.calls[0] == ([rec.prompt_ids], 2, 400)  # the first turn: n samples of the shared prompt
    assert backend.calls[1] == ([rec.prompt_ids + out1 + inserted], 1, 400 - len(out1) - len(inserted))
    assert first.token_ids == out1 + inserted + out2  # sampled ids kept as sampled, tool ids inserted between
    assert first.mask == [True] * len(out1) + [False] * len(inserted) + [True] * len(out2)
    lp = [-0.01 * (t + 1) for t in range(len(out1))] + [0.0] * len(inserted) + [-0.01 * (t + 1) for t in
                                                                             range(len(out2))]
    assert first.logprobs == pytest.approx(lp)
    assert first.num_sampled == len(out1) + len(out2) and first.finish_reason == "stop"
    assert [m["role"] for m in first.messages] == ["assistant", "tool", "assistant"]
    assert first.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 12, "b": 30}}
    assert first.messages[1]["content"] == "42" and first.messages[2]["content"].endswith("The answer is 42.")
    assert second.token_ids == backend.outputs[0][1] and all(second.mask) and second.info["turns"] == 1
    m = multiturn_metrics([first, second])
    assert m["tools/call_frequency"] == 0.5 and m["tools/failure_frequency"] == 0.0
    assert m["tools/calls/add"] == 1.0 and m["turns/mean"] == 1.5 and m["turns/max"] == 2.0


class Hint:
    """An environment that answers every turn with "lower" until the model says 5."""

    def reset(self, row):
        return None

    def step(self, text):
        from rlflow.environments import EnvStep

        if text.strip().endswith("5"):
            return EnvStep([], reward=1.0, done=True)
        return EnvStep([{"role": "user", "content": "lower"}], reward=-0.25)


def test_not_append_only_template_trained_ids_are_the_sampled_ids(tok):
    from rlflow.environments import Environment

    class HintEnv(Hint, Environment):
        pass

    mt = MultiTurn(tok, {}, environment=HintEnv(), max_turns=4)
    turn1, turn2 = "<think>\nmaybe 7\n</think>\n\n7" + END, "<think>\nless\n</think>\n\n5" + END
    backend = ScriptedBackend(tok, [[turn1], [turn2]])
    rec = record(tok, "Guess.")
    (c,), = mt.generate(backend, [rec], params(tok), n=1)
    inserted = ids(tok, "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n")
    assert c.token_ids == ids(tok, turn1) + inserted + ids(tok, turn2)
    assert c.mask == [True] * len(ids(tok, turn1)) + [False] * len(inserted) + [True] * len(ids(tok, turn2))
    assert c.env_reward == pytest.approx(0.75)
    # re-rendering the conversation, as a text-based loop would, drops the first turn's <think> block (it is now
    # before the last user query): the ids would drift from what was sampled; the trajectory's ids do not
    rerendered = ids(tok, tok.apply_chat_template(rec.prompt + c.messages, tokenize=False))
    assert rerendered != rec.prompt_ids + c.token_ids
    assert "maybe 7" not in tok.decode(rerendered) and "maybe 7" in tok.decode(c.token_ids)


def test_failing_tools_become_messages_and_are_counted(tok):
    tools = load_tools([add, boom, hang])
    mt = MultiTurn(tok, tools, max_turns=3, tool_timeout=0.3)
    calls = ['<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>',
             '<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": "1"}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>']
    backend = ScriptedBackend(tok, [[c + END for c in calls], ["ok" + END]])
    (group,) = mt.generate(backend, [record(tok, "Go.", tools)], params(tok), n=4)
    results = [c.messages[1]["content"] for c in group]
    assert "raised RuntimeError: boom 1" in results[0]
    assert "timed out after 0.3 s" in results[1]
    assert "missing a required argument: 'b'" in results[2]
    assert "could not be parsed: not valid JSON" in results[3]
    assert all(c.info["turns"] == 2 and c.messages[-1]["content"] == "ok" for c in group)  # the run went on
    m = multiturn_metrics(group)
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 1.0
    assert m["tools/failures/raised"] == 1 and m["tools/failures/timeout"] == 1
    assert m["tools/failures/bad_arguments"] == 2


def test_max_turns_stops_a_model_that_keeps_calling(tok):
    tools = load_tools([add])
    mt = MultiTurn(tok, tools, max_turns=3)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>' + END
    backend = ScriptedBackend(tok, [[call]] * 5)
    (group,) = mt.generate(backend, [record(tok, "Go.", tools)], params(tok, 2000), n=2)
    assert len(backend.calls) == 3  # three model turns, then no more generation
    for c in group:
        assert c.info["turns"] == 3 and c.info["tool_calls"] == {"add": 2}  # the last turn's call is not run
        assert [m["role"] for m in c.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert c.mask[-1] is True  # the trajectory ends with the model's own tokens


def test_token_budget_covers_the_whole_trajectory(tok):
    tools = load_tools([add])
    mt = MultiTurn(tok, tools, max_turns=10)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>' + END  # 60 tokens
    backend = ScriptedBackend(tok, [[call]] * 10)
    (group,) = mt.generate(backend, [record(tok, "Go.", tools)], params(tok, 150), n=1)
    c = group[0]
    assert len(c.token_ids) <= 150 and c.finish_reason == "length"
    budgets = [max_tokens for _, _, max_tokens in backend.calls]
    assert budgets[0] == 150 and budgets[1] == 150 - len(c.token_ids[: c.mask.index(True, len(ids(tok, call)))])


# --------------------------------------------------------------------------- real backends, full forward
def segments(c):
    """``[(start, end, sampled)]`` runs of the completion's mask."""
    runs, start = [], 0
    for i in range(1, len(c.mask) + 1):
        if i == len(c.mask) or c.mask[i] != c.mask[start]:
            runs.append((start, i, c.mask[start]))
            start = i
    return runs


@pytest.mark.parametrize("backend_name", ["hf", "engine"])
def test_real_backend_multiturn_is_token_exact_and_logprobs_match_a_full_forward(backend_name, tok, one_thread):
    from rlflow.rollout.engine import EngineRollout
    from rlflow.rollout.hf import HFRollout

    model = tiny_model(len(tok))
    inner = HFRollout(seed=0) if backend_name == "hf" else EngineRollout(seed=0)
    inner.bind(model, tok)
    backend = RecordingBackend(inner)

    from rlflow.environments import Environment

    class Always(Hint, Environment):  # a random model never says 5 at the end: every turn gets "lower"
        pass

    mt = MultiTurn(tok, {}, environment=Always(), max_turns=3)
    torch.manual_seed(0)
    recs = [record(tok, "Guess a number."), record(tok, "Guess again, please.")]
    groups = mt.generate(backend, recs, params(tok, max_tokens=40), n=2)
    inserted_text = "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    sampled_calls = {tuple(p): out.token_ids for (prompts, _), outs in zip(backend.calls, backend.outputs)
                     for p, out in zip(prompts, outs)}
    multi = 0
    for rec, group in zip(recs, groups):
        for c in group:
            runs = segments(c)
            multi += len(runs) > 1
            for start, end, sampled in runs:
                if sampled:  # the backend sampled exactly these ids, from exactly the trajectory before them
                    if start:
                        assert tuple(rec.prompt_ids + c.token_ids[:start]) in sampled_calls
                        assert sampled_calls[tuple(rec.prompt_ids + c.token_ids[:start])][: end - start] == \
                            c.token_ids[start:end]
                else:
                    assert tok.decode(c.token_ids[start:end]).endswith(inserted_text.lstrip("\n"))
    assert multi > 0  # some trajectory had more than one turn
    # log-probs: the sampler's equal a plain full forward of the trained sequence on every sampled token
    experiences = []
    for g, (rec, group) in enumerate(zip(recs, groups)):
        for c in group:
            seq = torch.tensor([rec.prompt_ids + c.token_ids])
            with torch.no_grad():
                full = torch.log_softmax(model(seq).logits[0].float(), -1)
            p = len(rec.prompt_ids)
            expected = full[p - 1: p - 1 + len(c.token_ids)].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            mask = torch.tensor(c.mask)
            assert torch.allclose(torch.tensor(c.logprobs)[mask], expected[mask], atol=2e-4)
            assert (torch.tensor(c.logprobs)[~mask] == 0).all()
            experiences.append((Experience(rec.prompt_ids, c.token_ids, c.logprobs, 0.0, 1.0, g, c.finish_reason, 0,
                                           sampled_mask=c.mask), expected))
    # the trainer's padded and packed forwards give the same log-probs, and the loss mask is the sampled mask
    exps = [e for e, _ in experiences]
    padded = collate(exps, pad_id=0)
    lp_padded, _ = completion_logprobs(model, padded)
    packed = collate_packed(exps, share_prompts=True)
    lp_packed, _ = packed_completion_logprobs(model, packed)
    for i, (e, expected) in enumerate(experiences):
        n = len(e.completion_ids)
        assert padded["completion_mask"][i, :n].tolist() == e.sampled_mask
        assert not padded["completion_mask"][i, n:].any() and padded["token_mask"][i, :n].all()
        mask = torch.tensor(e.sampled_mask)
        assert torch.allclose(lp_padded[i, :n][mask], expected[mask], atol=2e-4)
        assert torch.allclose(lp_packed[i, :n][mask], expected[mask], atol=2e-4)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"multiturn": {"tools": ["nope"]}}, "PluginError",
     "unknown rlflow.tools plugin 'nope'; available: calculator, python"),
    ({"multiturn": {"tools": ["calculator"], "parser": "nope"}}, "PluginError",
     "rlflow.tool_parsers plugin 'nope'; available: hermes"),
    ({"multiturn": {"environment": "nope"}}, "PluginError", "available: guess_number"),
    ({"multiturn": {"tools": ["calculator"], "max_turns": 0}}, "ConfigError", "data.multiturn.max_turns"),
    ({"multiturn": {"tools": ["calculator"], "tool_timeout": -1}}, "ConfigError", "data.multiturn.tool_timeout"),
])
def test_bad_multiturn_settings_fail_at_construction(kwargs, error, message, tmp_path):
    from rlflow.data.datamodule import RolloutDataModule

    (tmp_path / "train.jsonl").write_text('{"prompt": "x", "ground_truth": "1"}\n')
    with pytest.raises(Exception, match=message.replace("(", r"\(")) as info:
        RolloutDataModule(train_data_path=str(tmp_path / "train.jsonl"), **kwargs)
    assert type(info.value).__name__ == error


def test_lmdeploy_multiturn_sends_token_ids_once_per_turn(tok, monkeypatch):
    """On a fake ``lmdeploy serve api_server``: every turn of every trajectory is one ``/generate`` request whose
    ``input_ids`` are the trajectory's ids so far (the real engine needs a GPU: ``pytest -m gpu``)."""
    from rlflow.environments import Environment
    from rlflow.rollout.lmdeploy import LMDeployRollout
    from tests.unit.rollout.test_lmdeploy_rollout import EOS, FakeServer

    class Always(Hint, Environment):
        pass

    server = FakeServer()
    try:
        backend = LMDeployRollout(server_url=server.url, bucket_mb=1)
        monkeypatch.setattr(backend, "push_weights", lambda: setattr(backend, "weights_current", True))
        backend.bind(torch.nn.Linear(2, 2), tok)
        mt = MultiTurn(tok, {}, environment=Always(), max_turns=2)
        rec = record(tok, "Guess.")
        (group,) = mt.generate(backend, [rec], SamplingParams(max_tokens=200, stop_token_ids=[EOS]), n=2)
    finally:
        server.httpd.shutdown()
    bodies = [body for path, body in server.calls if path == "/generate"]
    assert len(bodies) == 4  # 2 trajectories x 2 turns
    # the trajectories run concurrently: one's second turn may reach the server before the other's first
    first = [b["input_ids"] for b in bodies if b["input_ids"] == rec.prompt_ids]
    later = [b["input_ids"] for b in bodies if b["input_ids"] != rec.prompt_ids]
    assert first == [rec.prompt_ids] * 2 and len(later) == 2
    for c in group:
        start = c.mask.index(True, c.mask.index(False))  # the second turn's first sampled token
        assert rec.prompt_ids + c.token_ids[:start] in later
        assert c.info["turns"] == 2 and not all(c.mask)


def test_tools_of_a_finished_group_run_while_other_groups_generate(tok):
    """On a backend that streams groups (the engine), the first group's tool call starts before the second group is
    generated: the stream below waits for the tool before yielding the second group."""
    import threading

    started = threading.Event()

    def ping(x: int) -> int:
        """Marks that a tool ran.

        Args:
            x: Returned as is.
        """
        started.set()
        return x

    class Streaming(ScriptedBackend):
        streams = True

        def stream(self, prompts, params, n=1, progress=None):
            groups = self.generate(prompts, params, n=n)
            for i, group in enumerate(groups):
                if i == 1 and len(self.calls) == 1:  # the first turn's second group
                    self.waited = started.wait(timeout=10)
                yield i, group

    tools = load_tools([ping])
    mt = MultiTurn(tok, tools, max_turns=2)
    call = '<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>' + END
    backend = Streaming(tok, [[call], ["done" + END]])
    groups = mt.generate(backend, [record(tok, "A.", tools), record(tok, "B.", tools)], params(tok), n=1)
    assert backend.waited is True  # the tool ran before the stream went on
    assert [g[0].messages[1]["content"] for g in groups] == ["1", "1"] and all(g[0].info["turns"] == 2 for g in groups)
