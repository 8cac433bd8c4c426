"""benchmarks/bench_roofline.py: the limits' arithmetic (weight and KV bytes, a decode step's reads, the packed
training step's FLOPs) against values worked out by hand for a tiny model, and a run of every part but the TRL
step at tiny sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_roofline as roof
from rlflow.data.experience import Experience
from rlflow.rollout.decode_state import DecodeState, LaneStates
from rlflow.training.packing import collate_packed
from rlflow.training.trainer import auto_precision
from tests.helpers.tiny_archs import tiny_causal_lm

# tiny_causal_lm("llama"): hidden 32, 4 heads x 8, 2 kv heads, mlp 64, 2 layers, vocab 128, untied LM head
LAYER_WEIGHTS = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * (32 * 64)  # q, k and v, o, gate/up/down: 9216
HEAD_WEIGHTS = 128 * 32
LINEAR_WEIGHTS = 2 * LAYER_WEIGHTS + HEAD_WEIGHTS  # 22528


@pytest.fixture(scope="module")
def llama():
    return tiny_causal_lm("llama")


def test_weight_and_kv_bytes_by_hand(llama):
    assert roof.weight_bytes(llama, torch.bfloat16) == 2 * LINEAR_WEIGHTS == 45056
    assert roof.weight_bytes(llama, torch.float32) == 4 * LINEAR_WEIGHTS
    # per token: 2 layers x (keys and values) x 2 kv heads x 8 dims
    assert roof.kv_column_bytes(llama.config, torch.bfloat16) == 2 * 2 * 2 * 8 * 2 == 128
    assert roof.kv_column_bytes(llama.config, torch.float32) == 256


def decode_state(n: int, prompt_lengths: list[int], head: int = 0) -> DecodeState:
    """A decode state of groups of ``n`` rows whose prompts (after a shared ``head``) have ``prompt_lengths`` real
    tokens, right-padded to the longest (as the fused prefill pads them)."""
    width, kv, dim = max(prompt_lengths), 2, 8
    shared = ([torch.zeros(kv, head, dim)] * 2, [torch.zeros(kv, head, dim)] * 2) if head else None
    state = DecodeState(n, max_tokens=8, head=shared)
    keys = [torch.zeros(len(prompt_lengths), kv, width, dim) for _ in range(2)]
    mask = (torch.arange(width)[None, :] < torch.tensor(prompt_lengths)[:, None]).long()
    state.add_groups(list(range(len(prompt_lengths))), keys, keys, mask)
    return state


def test_a_decode_steps_reads_by_hand():
    state = decode_state(2, [3, 4])
    # first step: each group's prompt once plus each row's one fed token; pairs per row
    assert roof.state_reads(state) == ((3 + 2 * 1) + (4 + 2 * 1), 2 * (3 + 1) + 2 * (4 + 1))
    state.begin_step()
    state.end_step()
    assert roof.state_reads(state) == ((3 + 2 * 2) + (4 + 2 * 2), 2 * (3 + 2) + 2 * (4 + 2))
    headed = decode_state(3, [2], head=5)  # the shared head is part of every group's prompt
    assert roof.state_reads(headed) == (5 + 2 + 3 * 1, 3 * (5 + 2 + 1))
    assert roof.state_reads(LaneStates([state, headed])) == (15 + 10, 22 + 24)


def test_a_group_joining_behind_others_reads_its_own_length():
    state = decode_state(2, [3])
    state.begin_step()
    state.end_step()  # the first group has fed one token
    state.add_groups([1], [torch.zeros(1, 2, 4, 8)] * 2, [torch.zeros(1, 2, 4, 8)] * 2, torch.ones(1, 4).long())
    assert state.fed is None  # per-group lengths
    assert roof.state_reads(state) == ((3 + 2 * 2) + (4 + 2 * 1), 2 * (3 + 2) + 2 * (4 + 1))


def test_the_decode_limits_per_step_by_hand(llama):
    args = SimpleNamespace(prompts=2, n=2)
    # one engine run: 1.0 s in all, 0.2 s of it prefilling, two decode steps of 4 rows
    runs = {"engine": [(1.0, 12, 0.2, [(0.01, 4, 10, 20), (0.03, 4, 12, 24)])], "generate": [(2.0, 12)]}
    limits = {"bandwidth": 1e9, "peak_bfloat16": 1e10}
    d = roof.summarise_decode(args, llama, torch.bfloat16, runs, limits)
    assert d["loop_s"] == pytest.approx((1.0 - 0.2) / 2)
    assert d["forward_s"] == pytest.approx(0.02)
    step_bytes = [2 * LINEAR_WEIGHTS + 10 * 128, 2 * LINEAR_WEIGHTS + 12 * 128]  # weights once, the KV read
    assert d["bytes_per_step"] == pytest.approx(46464) == sum(step_bytes) / 2
    assert d["roofline_s"] == pytest.approx(46464 / 1e9)
    # FLOPs: 2 x weights per row, 4 x layers x (heads x dim) per attended pair
    flops = [2 * LINEAR_WEIGHTS * 4 + 4 * 2 * 32 * 20, 2 * LINEAR_WEIGHTS * 4 + 4 * 2 * 32 * 24]
    assert flops == [185344, 186368]
    assert d["compute_floor_s"] == pytest.approx(185856 / 1e10)
    assert d["engine_tok_s"] == 12.0 and d["generate_tok_s"] == 6.0
    assert "roofline_s" not in roof.summarise_decode(args, llama, torch.bfloat16, runs, {})


def experience(prompt: list[int], completion: int, group: int) -> Experience:
    return Experience(prompt, list(range(3, 3 + completion)), [0.0] * completion, 0.0, 1.0, group, "stop", 0)


def two_groups() -> list[Experience]:
    """Two groups whose prompts share a 16-token head: 20 and 22 tokens, completions of 3 and 5, and 2."""
    head = list(range(40, 56))
    first, second = head + [60, 61, 62, 63], head + [70, 71, 72, 73, 74, 75]
    return [experience(first, 3, 0), experience(first, 5, 0), experience(second, 2, 1)]


def test_a_packs_tokens_and_attention_by_hand():
    exps = two_groups()
    # shared: the head once (16 tokens, causal), each prompt's tail once over the head, each completion over its prompt
    pairs = 136 + (210 - 136) + (253 - 136) + (3 * 20 + 6) + (5 * 20 + 15) + (2 * 22 + 3)
    assert roof.pack_work(exps, share_prompts=True) == (16 + 4 + 6 + 10, 10, pairs) == (36, 10, 555)
    # each sequence whole: 23, 25 and 24 tokens, causal
    assert roof.pack_work(exps, share_prompts=False) == (72, 10, 276 + 325 + 300)


@pytest.mark.parametrize("share", [True, False])
def test_a_packs_work_matches_the_collated_pack(share):
    """Independently of the count above: a packed token at position id ``i`` attends to ``i + 1`` keys (its prompt's
    and its own sequence's tokens up to itself), and the LM head multiplies one position per completion token."""
    exps = two_groups()
    batch = collate_packed(exps, share_prompts=share)
    tokens, predicted, pairs = roof.pack_work(exps, share)
    assert tokens == batch["input_ids"].numel()
    assert predicted == batch["logit_index"].numel()
    assert pairs == int((batch["position_ids"] + 1).sum())


def test_the_training_flops_by_hand(llama):
    # 3 x (2 x layer weights x tokens + 2 x head weights x completion tokens + 4 x layers x width x pairs)
    forward = 2 * (2 * LAYER_WEIGHTS) * 36 + 2 * HEAD_WEIGHTS * 10 + 4 * 2 * 32 * 555
    assert forward == 1551104
    assert roof.train_flops(llama, [(36, 10, 555)]) == 3 * forward
    assert roof.train_flops(llama, [(36, 10, 555), (36, 10, 555)]) == 6 * forward


def test_the_limits_measurements(llama, one_thread):
    threads = torch.get_num_threads()
    assert roof.copy_bandwidth(2, 1, threads=2) > 0
    assert torch.get_num_threads() == threads  # put back
    assert roof.matmul_rate(8, 16, 24, torch.float32, 1) > 0
    shapes = roof.matmul_shapes(llama.config, pack_tokens=100, chunk=50, square=64)
    assert [s[1:] for s in shapes] == [(64, 64, 64), (100, 32, 32), (100, 32, 64), (100, 64, 32), (50, 32, 128)]


def test_recipe_settings_and_the_step_command(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("trainer: {precision: bf16-mixed}\nmodel: {model_path: m, update: {pack_max_length: 512}}\n"
                      "data: {train_data_path: d.jsonl, global_batch_size: 3, prompt_repeat_k: 5,\n"
                      "       rollout: {class_path: engine, init_args: {dtype: auto}}, sampling: {temperature: 0.7}}\n")
    args = roof.parse_args(["--config", str(config), "--max-tokens", "20", "--threads", "1"])
    assert (args.model, args.data, args.prompts, args.n, args.temperature) == ("m", "d.jsonl", 3, 5, 0.7)
    assert (args.decode_dtype, args.precision, args.pack_max_length, args.chunk) == ("auto", "bf16-mixed", 512, 1024)
    assert roof.parse_args(["--config", str(config), "--n", "2"]).n == 2  # a flag wins over the recipe
    command = roof.step_command(args)
    flags = dict(zip(command, command[1:]))  # each flag -> the word after it
    assert [flags[f] for f in ("--prompts", "--group", "--max-tokens", "--micro-batch")] == ["3", "5", "20", "15"]
    assert "--bf16" in command and "--rlflow-args=--data.sampling.max_tokens=20" in command
    assert flags["--threads"] == "1" and flags["--config"] == str(config)
    config.write_text("trainer: {precision: auto}\n")  # the shipped CPU recipes: what rlflow fit trains in here
    assert roof.parse_args(["--config", str(config)]).precision == auto_precision("cpu")[0]


@pytest.mark.filterwarnings("ignore")
def test_it_runs_every_part_but_the_step_at_tiny_sizes(tiny_model, tiny_data, one_thread, capsys):
    results = roof.main([
        "--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--prompts", "2", "--n", "2",
        "--max-tokens", "4", "--repeats", "1", "--bandwidth-mib", "4", "--square", "64", "--pack-max-length", "64",
        "--chunk", "16", "--parts", "bandwidth", "matmul", "decode", "train",
    ])
    decode, train = results["decode"], results["train"]
    assert results["bandwidth"] > 0 and results["peak_float32"] > 0
    assert decode["rows"] == 4 and 0 < decode["roofline_s"] and 0 < decode["compute_floor_s"]
    assert decode["loop_s"] > 0 and decode["engine_tok_s"] > 0 and decode["generate_tok_s"] > 0
    # at these sizes a step is timer noise, so no order between products_s and forward_s is asserted
    assert decode["products_s"] > 0 and decode["weights_roofline_s"] > 0
    assert train["flops"] > 0 and train["packs"] >= 1
    # a share of the peak where this CPU's peak for the training dtype was measured (bfloat16 only where native)
    assert ("share" in train) == (f"peak_{train['dtype']}" in results)
    out = capsys.readouterr().out
    assert "decode products alone per step (4 rows" in out and "memory roofline of the weights" in out
    assert "figure" in out and "memory roofline" in out and "compute floor" in out and "model.generate" in out
    assert "matmul peak" in out and "GRPO step" not in out


def test_products_alone_runs_each_layers_four_products_and_the_head_per_step(monkeypatch):
    from rlflow.rollout import fused
    from tests.unit.rollout.test_fused_decoder import build

    decoder = fused.FusedDecoder(build("qwen3"))  # 2 layers
    calls = {"linear": [], "residual": []}
    linear, residual = fused._linear, fused._residual
    monkeypatch.setattr(fused, "_linear", lambda x, *a: calls["linear"].append(x.shape[0]) or linear(x, *a))
    monkeypatch.setattr(fused, "_residual", lambda h, x, *a: calls["residual"].append(x.shape[0]) or residual(h, x, *a))
    assert roof.products_alone(decoder, rows=3, repeats=1) > 0
    steps = 2 * 5  # best_time: one untimed call and one timed; 5 steps a call
    assert calls["linear"] == [3] * steps * (2 * 2 + 1) and calls["residual"] == [3] * steps * 2 * 2
