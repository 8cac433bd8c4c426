"""The ``lmdeploy`` rollout backend: request/response translation and the engine lifecycle on CPU, the real engine
on GPU.

The CPU tests need neither lmdeploy nor a GPU: the pure translation functions are checked against hand-written
expectations, and the backend's protocol (sleep, wake, push weights, generate) runs against a small fake
``api_server`` speaking the same HTTP endpoints.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import torch

from rlflow import registry
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.lmdeploy import (
    LMDeployError,
    LMDeployRollout,
    full_named_tensors,
    generate_payload,
    parse_generate_response,
    server_command,
    sleep_params,
    update_weights_bodies,
    wakeup_params,
    weight_buckets,
)
from rlflow.tools.base import ToolCall
from rlflow.tools.parsers import ToolParser

EOS = 2


# ------------------------------------------------------------------------------------------- translation
def test_sampling_options_map_one_to_one():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=1024, stop_token_ids=[EOS, 7], min_p=0.05,
                            repetition_penalty=1.1)
    body = generate_payload([5, 6, 7], params, model_name="policy")
    assert body == {
        "input_ids": [5, 6, 7], "max_tokens": 1024, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "stop_token_ids": [EOS, 7], "ignore_eos": False, "return_logprob": True,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "stream": False, "model": "policy",
    }
    greedy = generate_payload([5], SamplingParams(temperature=0.0, top_p=0.5, top_k=3, max_tokens=4))
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["min_p"]) == (1.0, 1, 1.0, 0.0)
    assert "model" not in greedy


def test_bad_requests_are_refused_before_reaching_the_engine():
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        generate_payload([1], SamplingParams(temperature=2.5))
    with pytest.raises(ValueError, match="empty"):
        generate_payload([], SamplingParams())


def _answer(ids, logprobs, reason="stop", pair_ids=None):
    pairs = [[lp, t] for lp, t in zip(logprobs, pair_ids or ids)]
    return {"text": "", "output_ids": ids, "meta_info": {"finish_reason": {"type": reason},
                                                         "output_token_logprobs": pairs}}


def test_response_keeps_the_stop_token_and_its_logprob():
    params = SamplingParams(max_tokens=8, stop_token_ids=[EOS])
    c = parse_generate_response(_answer([11, 12, EOS], [-0.5, -1.25, -0.125]), params)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([11, 12, EOS], [-0.5, -1.25, -0.125], "stop")


def test_response_cut_at_max_tokens_or_first_stop():
    params = SamplingParams(max_tokens=3, stop_token_ids=[EOS])
    c = parse_generate_response(_answer([11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0], reason="length"), params)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([11, 12, 13], [-1.0, -2.0, -3.0], "length")
    c = parse_generate_response(
        _answer([11, EOS, 13], [-1.0, -2.0, -3.0]), SamplingParams(max_tokens=8, stop_token_ids=[EOS])
    )
    assert (c.token_ids, c.finish_reason) == ([11, EOS], "stop")


def test_malformed_responses_name_the_problem():
    params = SamplingParams(max_tokens=8, stop_token_ids=[EOS])
    with pytest.raises(LMDeployError, match="logprobs_mode"):
        parse_generate_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}, params)
    with pytest.raises(LMDeployError, match="2 log-probs for 3"):
        parse_generate_response(_answer([1, 2, 3], [-1.0, -1.0]), params)
    with pytest.raises(LMDeployError, match="token 9"):
        parse_generate_response(_answer([1, EOS], [-1.0, -1.0], pair_ids=[1, 9]), params)
    with pytest.raises(LMDeployError, match="aborted"):
        parse_generate_response(_answer([1], [-1.0], reason="abort"), params)
    with pytest.raises(LMDeployError, match="output_ids"):
        parse_generate_response({"text": "hi"}, params)


def test_sleep_and_wakeup_queries():
    assert sleep_params(2) == {"tags": ["weights", "kv_cache"], "level": 2}
    assert wakeup_params(["kv_cache"]) == {"tags": ["kv_cache"]}
    with pytest.raises(ValueError, match="1 or 2"):
        sleep_params(3)
    with pytest.raises(ValueError, match="weights"):
        wakeup_params(["optimizer"])


def test_weight_buckets_keep_order_and_size():
    f32 = lambda n: torch.zeros(n, dtype=torch.float32)  # noqa: E731 - 4 bytes per element
    named = [("a", f32(10)), ("b", f32(10)), ("c", f32(30)), ("d", f32(5)), ("e", f32(5)), ("f", f32(1))]
    buckets = [[n for n, _ in b] for b in weight_buckets(named, bucket_bytes=80)]
    # a+b = 80 bytes fill one bucket; c (120 bytes) is bigger than a bucket and goes alone; d+e+f = 44 bytes
    assert buckets == [["a", "b"], ["c"], ["d", "e", "f"]]
    with pytest.raises(ValueError, match="positive"):
        list(weight_buckets(named, 0))


def test_update_bodies_finish_on_the_last_bucket():
    buckets = [[("a", torch.ones(1))], [("b", torch.ones(1))], [("c", torch.ones(1))]]
    bodies = list(update_weights_bodies(buckets, lambda b: [n for n, _ in b], "flattened_bucket"))
    assert [b["serialized_named_tensors"] for b in bodies] == [["a"], ["b"], ["c"]]
    assert [b["finished"] for b in bodies] == [False, False, True]
    assert all(b["load_format"] == "flattened_bucket" for b in bodies)
    empty = list(update_weights_bodies([], lambda b: b, None))
    assert empty == [{"serialized_named_tensors": {}, "finished": True}]


def test_server_command_asks_for_raw_logprobs():
    cmd = server_command("/models/qwen3-8b", 23335, 1, 0.4, "bfloat16", 2048, 256, ["--enable-prefix-caching"])
    joined = " ".join(cmd)
    for piece in ("serve api_server /models/qwen3-8b", "--backend pytorch", "--server-port 23335", "--tp 1",
                  "--cache-max-entry-count 0.4", "--logprobs-mode raw_logprobs", "--session-len 2048",
                  "--max-batch-size 256", "--server-name 127.0.0.1", "--enable-prefix-caching"):
        assert piece in joined, piece


def test_full_named_tensors_uses_hf_names_and_casts(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    named = dict(full_named_tensors(model, torch.bfloat16))
    assert named.keys() == model.state_dict().keys()
    assert all(t.dtype == torch.bfloat16 for t in named.values())
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(named[key], model.state_dict()[key].to(torch.bfloat16))


def test_registered_and_validated():
    assert "lmdeploy" in registry.available("rlflow.rollout")
    backend = registry.build(
        "rlflow.rollout", {"class_path": "lmdeploy", "init_args": {"sleep_level": 1, "bucket_mb": 64}}
    )
    assert isinstance(backend, LMDeployRollout) and backend.bucket_bytes == 64 * 2**20
    assert backend.reads_policy_weights is False  # the trainer does not unshard the policy for it
    with pytest.raises(ValueError, match="tp=1"):
        LMDeployRollout(tp=2)
    with pytest.raises(ValueError, match="1 or 2"):
        LMDeployRollout(sleep_level=3)


# ------------------------------------------------------------------------------- lifecycle on a fake server
class FakeServer:
    """The endpoints of ``lmdeploy serve api_server`` the backend uses, recording every call."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.kv = True
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply(200, {"status": "ok"})

            def do_POST(self):
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                query = parse_qs(url.query)
                outer.calls.append((url.path, query if url.path in ("/sleep", "/wakeup") else body))
                if url.path == "/sleep":
                    outer.kv = False
                elif url.path == "/wakeup" and "kv_cache" in query.get("tags", []):
                    outer.kv = True
                elif url.path == "/update_weights" and outer.kv:
                    return self._reply(400, {"error": "release the KV cache before updating weights"})
                elif url.path == "/generate":
                    if not outer.kv:
                        return self._reply(500, {"error": "KV cache is asleep"})
                    ids = [t + 1 for t in body["input_ids"][-2:]] + [EOS]  # a deterministic "sample"
                    pairs = [[-0.5 * (i + 1), t] for i, t in enumerate(ids)]
                    meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": pairs}
                    return self._reply(200, {"text": "", "output_ids": ids, "meta_info": meta})
                self._reply(200, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self):
        return [path for path, _ in self.calls]


@pytest.fixture
def fake_server():
    server = FakeServer()
    yield server
    server.httpd.shutdown()


def test_lifecycle_pushes_weights_once_per_stale_rollout(fake_server, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    backend = LMDeployRollout(server_url=fake_server.url, bucket_mb=1)
    pushed: list[list[str]] = []
    monkeypatch.setattr(backend, "_safetensors_serializer",
                        lambda: ((lambda bucket: pushed.append([n for n, _ in bucket]) or len(pushed)), "safetensors"))
    backend.bind(model, tokenizer=None)
    params = SamplingParams(max_tokens=8, stop_token_ids=[EOS])
    groups = backend.generate([[5, 6, 7], [9, 10]], params, n=2)
    # the first rollout pushes the weights: KV cache released, weights woken, one bucket, KV cache woken, then sampling
    assert fake_server.paths() == ["/sleep", "/wakeup", "/update_weights", "/wakeup"] + ["/generate"] * 4
    assert fake_server.calls[1][1]["tags"] == ["weights"] and fake_server.calls[3][1]["tags"] == ["kv_cache"]
    assert fake_server.calls[2][1] == {"serialized_named_tensors": 1, "finished": True, "load_format": "safetensors"}
    assert pushed == [list(model.state_dict())]
    assert [[c.token_ids for c in g] for g in groups] == [[[7, 8, EOS]] * 2, [[10, 11, EOS]] * 2]
    assert groups[0][0].logprobs == [-0.5, -1.0, -1.5] and groups[0][0].finish_reason == "stop"
    # no optimizer step since: no push
    fake_server.calls.clear()
    backend.generate([[1, 2]], params, n=1)
    assert fake_server.paths() == ["/generate"]
    # an optimizer step makes the engine stale; two steps still cost one push
    backend.sync_weights()
    backend.sync_weights()
    fake_server.calls.clear()
    backend.generate([[1, 2]], params, n=1)
    assert fake_server.paths().count("/update_weights") == 1 and fake_server.paths()[-1] == "/generate"


def test_server_errors_surface_with_the_endpoint(fake_server):
    backend = LMDeployRollout(server_url=fake_server.url)
    backend.url = fake_server.url
    with pytest.raises(LMDeployError, match="/update_weights failed: HTTP 400"):
        backend._request("POST", "/update_weights", body={"serialized_named_tensors": {}, "finished": True})


# ------------------------------------------------------------------------------- multi-turn on a fake server
class EveryTurnGate(ToolParser):
    """Every turn calls ``gate`` (whatever the fake server "sampled")."""

    def parse(self, text):
        return text, [ToolCall("gate", {"x": len(text)})]


def gated_lmdeploy_rollout(fake_server, wait: float):
    """A colocated, asleep backend on the fake server; one record, two trajectories calling ``gate``."""
    from rlflow.data.dataset import PromptRecord
    from rlflow.rollout.multiturn import MultiTurn
    from rlflow.tools.base import load_tools
    from tests.helpers.multiturn_helpers import qwen3_char_tokenizer

    tok = qwen3_char_tokenizer()
    lock, release, count = threading.Lock(), threading.Event(), [0]

    def gate(x: int) -> int:
        """Waits for a later turn on the first call.

        Args:
            x: Returned as is.
        """
        with lock:
            count[0] += 1
            number = count[0]
        fake_server.calls.append(("tool start", {"number": number}))
        if number == 3:
            release.set()
        if number == 1 and not release.wait(wait):
            raise RuntimeError("no later turn started while the first call waited")
        fake_server.calls.append(("tool end", {"number": number}))
        return x

    backend = LMDeployRollout(sleep_level=1, max_concurrency=4)  # colocated: sleeps between rollouts
    backend.colocated_problem = lambda: None  # as on a GPU machine with lmdeploy
    backend.bind(torch.nn.Linear(2, 2), tok)
    backend.url, backend.weights_current = fake_server.url, True  # the server "started", the weights pushed
    backend.weights_awake = backend.kv_awake = False  # asleep since the last rollout
    mt = MultiTurn(tok, load_tools([gate]), parser=EveryTurnGate(), max_turns=3, tool_timeout=60)
    prompt = [{"role": "user", "content": "Wait for me."}]
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    record = PromptRecord(prompt, {}, "test.jsonl:1", tok.encode(text, add_special_tokens=False), text)
    params = SamplingParams(temperature=1.0, max_tokens=300, stop_token_ids=[EOS])
    (group,) = mt.generate(backend, [record], params, n=2)
    return record, group


def test_multiturn_sends_a_ready_turn_while_another_tool_waits(fake_server):
    """Two trajectories, a tool call after every turn. The first call waits until the third call starts, which only
    another trajectory's second turn can make: turn by turn it would time out (the turn-by-turn loop waits for every
    tool of a turn). Here the other trajectory's next /generate reaches the server while the first call still
    waits, the held trajectory goes on after it, and the colocated engine is woken once before and put to sleep
    once after the whole rollout, not around each request."""
    record, group = gated_lmdeploy_rollout(fake_server, wait=30.0)
    assert sorted(c.info["turns"] for c in group) == [3, 3] and all(not c.info["tool_failures"] for c in group)
    events = fake_server.calls
    paths = [path for path, _ in events]
    assert paths[0] == "/wakeup" and sorted(events[0][1]["tags"]) == ["kv_cache", "weights"]
    assert paths[-1] == "/sleep" and paths.count("/sleep") == paths.count("/wakeup") == 1
    generates = [i for i, (path, _) in enumerate(events) if path == "/generate"]
    assert len(generates) == 6  # 2 trajectories x 3 turns, one request each
    prompt_len = len(record.prompt_ids)
    held_end = next(i for i, (path, body) in enumerate(events) if path == "tool end" and body["number"] == 1)
    # a second-turn request (longer than the prompt) of the other trajectory went out while call 1 still waited
    later_turns = [i for i in generates if len(events[i][1]["input_ids"]) > prompt_len]
    assert later_turns and later_turns[0] < held_end
    assert sum(i < held_end for i in generates) >= 3  # both first turns and the other trajectory's second turn
    # every request continues its trajectory's own ids: a later turn's input starts with the prompt
    assert all(events[i][1]["input_ids"][:prompt_len] == record.prompt_ids for i in generates)

def test_turn_by_turn_lmdeploy_would_wait_for_the_gate(fake_server, monkeypatch):
    """The check above can fail: without ``serve`` (the turn-by-turn loop) no second turn starts while call 1
    waits, so it times out, and the engine sleeps and wakes around every turn's batch."""
    monkeypatch.delattr(LMDeployRollout, "serve")
    _, group = gated_lmdeploy_rollout(fake_server, wait=1.0)
    assert sum(c.info["tool_failures"].get("raised", 0) for c in group) == 1
    assert fake_server.paths().count("/sleep") == 3


def test_serve_yields_each_request_as_it_answers_and_raises_server_errors(fake_server):
    """A plain request list through serve: one completion group per request (n rows, n /generate calls), rows
    cut at the request's own max_tokens; a server error surfaces instead of hanging the loop."""
    from rlflow.rollout.requests import DecodeRequest, ListSource

    backend = LMDeployRollout(server_url=fake_server.url)
    backend.bind(torch.nn.Linear(2, 2), tokenizer=None)
    backend.url, backend.weights_current = fake_server.url, True
    params = SamplingParams(max_tokens=8, stop_token_ids=[EOS])
    out = dict((r.tag, g) for r, g in backend.serve(ListSource([
        DecodeRequest([5, 6, 7], [0, 0], tag="a"), DecodeRequest([9, 10], [0], max_tokens=2, tag="b")]), params))
    assert [c.token_ids for c in out["a"]] == [[7, 8, EOS]] * 2
    assert [(c.token_ids, c.finish_reason) for c in out["b"]] == [([10, 11], "length")]
    assert fake_server.paths() == ["/generate"] * 3
    assert sorted(body["max_tokens"] for _, body in fake_server.calls) == [2, 8, 8]
    fake_server.kv = False  # the fake answers HTTP 500
    with pytest.raises(LMDeployError, match="/generate failed: HTTP 500"):
        list(backend.serve(ListSource([DecodeRequest([1, 2], [0])]), params))


# ------------------------------------------------------------------------------------------ the real engine
HAVE_LMDEPLOY = importlib.util.find_spec("lmdeploy") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_LMDEPLOY),
                    reason="needs a CUDA GPU and lmdeploy (pip install 'rlflow[lmdeploy]') "
                           "to run LMDeploy's PyTorch engine")
def test_real_engine_samples_syncs_and_matches_trainer_logprobs(tiny_model):
    """Colocated engine on the tiny model: log-probs agree with the trainer's, and pushed weights take effect."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.data.experience import Experience, collate
    from rlflow.training.logprobs import completion_logprobs

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).cuda()
    backend = LMDeployRollout(model_path=str(tiny_model), cache_max_entry_count=0.1, dtype="bfloat16")
    try:
        backend.bind(model, tok)
        params = SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=[tok.eos_token_id])
        prompt = tok("What is 2 + 3?", add_special_tokens=False)["input_ids"]
        group = backend.generate([prompt], params, n=4)[0]
        exps = [Experience(prompt, c.token_ids, c.logprobs, 0.0, 0.0, 0, c.finish_reason, 0) for c in group]
        batch = {k: v.cuda() for k, v in collate(exps, tok.pad_token_id).items()}
        with torch.no_grad():
            trainer_lp, _ = completion_logprobs(model, batch)
        mask = batch["completion_mask"]
        assert (trainer_lp - batch["rollout_logprobs"])[mask].abs().mean() < 0.05  # bf16 engines differ a little
        with torch.no_grad():  # zero the LM head: after a push every token is equally likely
            model.lm_head.weight.zero_()
        backend.sync_weights()
        after = backend.generate([prompt], params, n=2)[0]
        uniform = -torch.log(torch.tensor(float(model.config.vocab_size))).item()
        assert all(abs(lp - uniform) < 1e-2 for c in after for lp in c.logprobs)
    finally:
        backend.close()


def test_a_colocated_engine_this_machine_cannot_start_is_refused_when_bound(monkeypatch):
    from rlflow.rollout.base import UnsupportedModelError

    backend = LMDeployRollout()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UnsupportedModelError, match="the lmdeploy rollout backend cannot run this model: its engine "
                                                    "runs on a CUDA GPU and none is visible; use data.rollout=auto"):
        backend.bind(torch.nn.Linear(2, 2), tokenizer=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UnsupportedModelError, match=r"lmdeploy is not installed \(pip install 'rlflow\[lmdeploy\]'\)"):
        backend.bind(torch.nn.Linear(2, 2), tokenizer=None)
    LMDeployRollout(server_url="http://127.0.0.1:9").bind(torch.nn.Linear(2, 2), tokenizer=None)  # engines elsewhere
