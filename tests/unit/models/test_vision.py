"""Vision-language GRPO on a tiny random Qwen2.5-VL built from a config (tests/helpers/tiny_vlm.py), on synthetic
images.

Log-probs with images are checked against the model's own forward of each sequence alone, with the processor's
pixel values computed separately in the test; the data path (relative paths, URLs, bytes, datasets Images, data
check), the rollout backends' handling of VLMs, the loss mask and the replay buffer's checkpoint are checked too
(``rlflow fit`` on the tiny VLM: ``tests/integration/test_vision_fit.py``).
"""


from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.data.dataset import DataError
from rlflow.data.experience import Experience, collate
from rlflow.data.images import open_image
from rlflow.data.prompts import PromptSet
from rlflow.data.sources import parse_sources
from rlflow.models.vision import (
    ImageInputs,
    ImagePrompt,
    VisionBatches,
    freeze_vision_tower,
    load_processor,
    model_auto_class,
    vision_tower,
)
from rlflow.rollout.base import SamplingParams
from rlflow.training.logprobs import completion_logprobs
from tests.helpers import tiny_vlm

TOKENS_PER_IMAGE = (tiny_vlm.IMAGE_SIZE // 14) ** 2 // 4  # 4 x 4 patches merged 2 x 2


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm.build_processor()


@pytest.fixture(scope="module")
def vlm(processor):
    return tiny_vlm.tiny_vlm(processor, seed=0)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return tiny_vlm.build(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> Path:
    return tiny_vlm.write_squares_data(tmp_path_factory.mktemp("squares") / "data", rows=4)


def image_bytes(counts: dict[str, int], seed: int) -> bytes:
    buffer = io.BytesIO()
    tiny_vlm.squares_image(counts, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def encode(processor, text: str, images: list) -> dict:
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[rendered], images=[open_image(i) for i in images] or None, return_tensors="pt")


def reference_logprobs(model, processor, images: list, prompt_text: str, completion: list[int]) -> torch.Tensor:
    """The model's own forward of one sequence alone (no padding), pixel values from the processor's __call__."""
    enc = encode(processor, prompt_text, images)
    ids = torch.cat([enc["input_ids"], torch.tensor([completion])], dim=1)
    kwargs = {"input_ids": ids}
    if images:
        types = torch.cat([enc["mm_token_type_ids"], torch.zeros(1, len(completion), dtype=torch.int)], dim=1)
        kwargs.update(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=types)
    with torch.no_grad():
        logits = model(**kwargs).logits[0].float()
    p = enc["input_ids"].shape[1]
    return torch.log_softmax(logits[p - 1: -1], dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def experiences_of(processor, cases) -> list[Experience]:
    out = []
    for g, (images, text, completion) in enumerate(cases):
        prompt = encode(processor, text, images)["input_ids"][0].tolist()
        out.append(Experience(prompt, completion, [0.0] * len(completion), 0.0, 1.0, g, "stop", 0,
                              images=list(images) or None))
    return out


CASES = [  # two images in one prompt, one image, none (a text-only row of the same VLM); different lengths
    ([image_bytes({"red": 2, "blue": 1}, 0), image_bytes({"green": 3}, 1)], "Count them.", [40, 41, 42, 9]),
    ([image_bytes({"red": 1}, 2)], "How many red squares?", [50, 51]),
    ([], "No picture here.", [60, 61, 62]),
]


# ------------------------------------------------------------------------------------------- log-probs
def test_logprobs_with_images_equal_each_sequence_s_own_forward(vlm, processor):
    """Padded micro-batches (in any order) with each sequence's images give its unpadded forward's log-probs."""
    exps = experiences_of(processor, CASES)
    vision = VisionBatches(vlm, processor)
    for order in ([0, 1, 2], [2, 0, 1], [1], [0, 2]):  # micro-batches keep each sample's images with it
        micro = [exps[i] for i in order]
        batch = vision.add_inputs(collate(micro, pad_id=0), micro, pad_id=0)
        assert "pixel_values" in batch and "position_ids" not in batch
        with torch.no_grad():
            lp, _ = completion_logprobs(vlm, batch, chunk_size=3)
        for row, i in enumerate(order):
            images, text, completion = CASES[i]
            want = reference_logprobs(vlm, processor, images, text, completion)
            assert torch.allclose(lp[row, : len(completion)], want, atol=2e-5), (order, i)


def test_images_change_the_logprobs(vlm, processor):
    """The pixels are in context: the same tokens after another image of the same size score differently."""
    same_ids = experiences_of(processor, [CASES[1]])[0]
    other = Experience(same_ids.prompt_ids, same_ids.completion_ids, [0.0, 0.0], 0.0, 1.0, 0, "stop", 0,
                       images=[image_bytes({"blue": 3}, 7)])
    vision = VisionBatches(vlm, processor)
    with torch.no_grad():
        a, _ = completion_logprobs(vlm, vision.add_inputs(collate([same_ids], 0), [same_ids], 0))
        b, _ = completion_logprobs(vlm, vision.add_inputs(collate([other], 0), [other], 0))
    assert (a - b).abs().max() > 1e-4


def test_image_tokens_never_enter_the_loss(vlm, processor):
    """The loss mask covers completion tokens only: never a prompt image token, and a vision placeholder sampled
    into a completion is masked out (and replaced in the input, where the model would look for an image)."""
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    exps = experiences_of(processor, CASES[:2])
    exps[1].completion_ids = [50, image_pad, 51]
    exps[1].rollout_logprobs = [0.0] * 3
    batch = VisionBatches(vlm, processor).add_inputs(collate(exps, pad_id=0), exps, pad_id=0)
    width = batch["completion_ids"].shape[1]
    mask = batch["completion_mask"]
    assert mask[1].tolist() == [True, False, True, False]
    assert mask[0].tolist() == [True, True, True, True]
    trained_inputs = batch["input_ids"][:, -width:][mask]
    assert not (trained_inputs == image_pad).any()
    image_positions = (batch["input_ids"] == image_pad).nonzero()[:, 1]
    assert image_positions.numel() == 3 * TOKENS_PER_IMAGE
    assert (image_positions < batch["input_ids"].shape[1] - width).all()  # all of them in the prompts
    with torch.no_grad():  # the forward runs: placeholders and images agree in number
        lp, _ = completion_logprobs(vlm, batch)
    assert torch.isfinite(lp[mask]).all()


def test_vision_tower_frozen_and_language_layers_get_gradients(processor):
    model = tiny_vlm.tiny_vlm(processor, seed=1).train()
    frozen = freeze_vision_tower(model)
    tower = vision_tower(model)
    assert frozen == sum(p.numel() for p in tower.parameters()) > 0
    exps = experiences_of(processor, CASES[:2])
    batch = VisionBatches(model, processor).add_inputs(collate(exps, 0), exps, 0)
    lp, _ = completion_logprobs(model, batch)
    lp[batch["completion_mask"]].sum().backward()
    assert all(p.grad is None for p in tower.parameters())
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_fsdp_units_cover_language_layers_and_vision_blocks(vlm):
    from rlflow.training.distributed import decoder_layers

    names = {type(m).__name__ for m in decoder_layers(vlm)}
    assert names == {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"}
    assert len(decoder_layers(vlm)) == len(vlm.model.language_model.layers) + len(vlm.model.visual.blocks)


# --------------------------------------------------------------------------------------------- rollout
def test_engine_refuses_vlms_and_auto_falls_back_to_hf(vlm, processor):
    from rlflow.rollout.engine_support import static_unsupported_reason
    from rlflow.rollout.hf import HFRollout
    from rlflow.rollout.select import resolve_backend
    from rlflow.training.packing_support import resolve_packing

    assert "vision-language" in static_unsupported_reason(vlm)
    assert isinstance(resolve_backend("auto", vlm, processor.tokenizer), HFRollout)
    assert resolve_packing(True, [vlm], sharded=False, pack_max_length=256) is False


def test_hf_rollout_generates_with_pixels_and_never_samples_a_placeholder(processor):
    """Rollout log-probs equal the training log-probs with the same images; a placeholder token made the most
    likely one is still never sampled."""
    from rlflow.rollout.hf import HFRollout

    model = tiny_vlm.tiny_vlm(processor, seed=2)
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():  # tied embeddings: the placeholder's logit dominates every step
        model.lm_head.weight[image_pad] *= 50.0
    exps = experiences_of(processor, CASES)
    prompts = [ImagePrompt(e.prompt_ids, e.images, "", ImageInputs(processor)(e.images)) if e.images else e.prompt_ids
               for e in exps]
    backend = HFRollout(batch_size=4)
    backend.bind(model, processor.tokenizer)
    torch.manual_seed(0)
    groups = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=5), n=2)
    done = [Experience(e.prompt_ids, c.token_ids, c.logprobs, 0.0, 1.0, 0, c.finish_reason, 0, images=e.images)
            for e, group in zip(exps, groups) for c in group]
    assert all(image_pad not in d.completion_ids for d in done)
    batch = VisionBatches(model, processor).add_inputs(collate(done, 0), done, 0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch)
    mask = batch["completion_mask"]
    assert torch.allclose(lp[mask], batch["rollout_logprobs"][mask], atol=1e-4)


def test_backend_that_would_drop_images_is_refused(squares, processor):
    from rlflow.models.vision import check_backend_accepts_images
    from rlflow.rollout.base import RolloutBackend

    records = PromptSet(parse_sources(str(squares)), "train", 512).load(processor.tokenizer, processor)
    with pytest.raises(ConfigError, match="does not take images"):
        check_backend_accepts_images(RolloutBackend(), records)


def test_lmdeploy_request_carries_the_images(processor):
    from rlflow.rollout.lmdeploy import generate_payload

    png = image_bytes({"red": 2}, 3)
    prompt = ImagePrompt([1, 2, 3], [png], "<|vision_start|><|image_pad|><|vision_end|>How many?")
    body = generate_payload(prompt, SamplingParams(max_tokens=4))
    assert "input_ids" not in body and body["prompt"] == prompt.text and len(body["image_data"]) == 1
    head, payload = body["image_data"][0].split(",", 1)
    assert head == "data:image/png;base64"
    sent = open_image(base64.b64decode(payload))
    assert list(sent.getdata()) == list(open_image(png).getdata())
    assert generate_payload([1, 2, 3], SamplingParams(max_tokens=4))["input_ids"] == [1, 2, 3]  # text unchanged


# ------------------------------------------------------------------------------------------------ data
def test_relative_image_paths_and_image_tokens_in_the_prompt_length(squares, processor, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # paths are relative to the data file, not the working directory
    records = PromptSet(parse_sources(str(squares)), "train", 512).load(processor.tokenizer, processor)
    first = records[0]
    assert first.images == [str((squares.parent / "images" / "0.png").resolve())]
    assert first.columns["images"] == first.images  # judgers get paths they can open
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert first.prompt_ids.count(image_pad) == TOKENS_PER_IMAGE
    text_only = len(processor.tokenizer(first.prompt_text, add_special_tokens=False)["input_ids"])
    assert len(first.prompt_ids) == text_only + TOKENS_PER_IMAGE - 1
    # a limit the text fits in but text + image tokens do not: every prompt is dropped
    with pytest.raises(DataError, match="all 4 are longer"):
        PromptSet(parse_sources(str(squares)), "train", text_only + 1).load(processor.tokenizer, processor)


def test_urls_and_text_only_models_are_refused_with_file_and_line(tmp_path, processor):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "images": ["https://example.com/a.png"]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'images\[0\]'.*URL.*download"):
        PromptSet(parse_sources(str(tmp_path / "d.jsonl")), "train", 512).load(processor.tokenizer, processor)
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "image": "x.png"}]
    (tmp_path / "e.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match=r"e\.jsonl:1: the row has images but the model is text-only"):
        PromptSet(parse_sources(str(tmp_path / "e.jsonl")), "train", 512).load(processor.tokenizer, None)


def test_bytes_data_uris_and_datasets_image_feature(tmp_path, processor):
    import datasets

    png = image_bytes({"green": 2}, 4)
    rows = [{"prompt": [{"role": "user", "content": "a"}], "image": "data:image/png;base64," + base64.b64encode(png)
             .decode()},
            {"prompt": [{"role": "user", "content": "b"}], "images": [{"bytes": base64.b64encode(png).decode()}]}]
    (tmp_path / "u.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recs = PromptSet(parse_sources(str(tmp_path / "u.jsonl")), "train", 512).load(processor.tokenizer, processor)
    assert [r.images for r in recs] == [[png], [png]]
    features = datasets.Features({"prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                                  "images": datasets.Sequence(datasets.Image())})
    ds = datasets.Dataset.from_dict({"prompt": [rows[0]["prompt"]], "images": [[tiny_vlm.squares_image({"red": 1})]]},
                                    features=features)
    ds.save_to_disk(str(tmp_path / "saved"))
    (saved,) = PromptSet(parse_sources(str(tmp_path / "saved")), "train", 512).load(processor.tokenizer, processor)
    assert isinstance(saved.images[0], bytes)
    assert list(open_image(saved.images[0]).getdata()) == list(tiny_vlm.squares_image({"red": 1}).getdata())


def test_data_check_validates_every_image_with_file_and_line(tmp_path, vlm_dir, capsys):
    """Missing and undecodable images are errors naming file:line and field; the good row's length is the one
    training computes, image tokens included."""
    from rlflow.data.check import main

    data = tiny_vlm.write_squares_data(tmp_path / "d", rows=3)
    processor = load_processor(str(vlm_dir))
    first = PromptSet(parse_sources(str(data)), "train", 512).load(processor.tokenizer, processor)[0]
    (tmp_path / "d" / "images" / "1.png").unlink()
    (tmp_path / "d" / "images" / "2.png").write_bytes(b"not an image")
    code = main(["check", str(data), "--tokenizer", str(vlm_dir), "--judgers", '{"*": "gsm8k"}'])
    out = capsys.readouterr().out
    assert code == 1
    assert f"{data}:2: field 'images[0]': image file" in out and "not found" in out
    assert f"{data}:3: field 'images[0]': cannot decode image" in out
    assert "rows 3 | malformed 2" in out
    assert f"max {len(first.prompt_ids)}  (max_prompt_length" in out
    assert main(["check", str(data), "--judgers", '{"*": "gsm8k"}']) == 1  # no tokenizer: the images are still read
    out = capsys.readouterr().out
    assert f"{data}:2: field 'images[0]'" in out and f"{data}:3: field 'images[0]'" in out


def test_replay_buffer_with_images_survives_a_weights_only_checkpoint(tmp_path):
    from rlflow.data.datamodule import RolloutDataModule

    dm = RolloutDataModule(train_data_path=str(tmp_path / "unused.jsonl"), judging={"judgers": {"*": "gsm8k"}})
    exps = [Experience([1, 2], [3], [0.0], 1.0, 0.5, 0, "stop", 0, images=["/data/a.png", b"\x89PNG..."]),
            Experience([1, 2], [4], [0.0], 0.0, -0.5, 0, "stop", 0)]
    dm.buffer.add(exps)
    torch.save(dm.state_dict(), tmp_path / "state.pt")
    other = RolloutDataModule(train_data_path=str(tmp_path / "unused.jsonl"), judging={"judgers": {"*": "gsm8k"}})
    other.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert [e.images for e in other.buffer.drain(1)[0]] == [["/data/a.png", b"\x89PNG..."], None]


# ----------------------------------------------------------------------------------------- FSDP2 on 2 ranks
def _vlm_sharded_worker(rank: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from rlflow.training.distributed import full_tensor, shard_model, sharded_completion_logprobs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        processor = load_processor(model_dir)
        plain = model_auto_class(model_dir).from_pretrained(model_dir)
        sharded = model_auto_class(model_dir).from_pretrained(model_dir)
        for model in (plain, sharded):
            freeze_vision_tower(model)  # the default: frozen tower blocks are FSDP units of their own
        shard_model(sharded, init_device_mesh("cpu", (2,)))
        exps = experiences_of(processor, CASES)
        batch = VisionBatches(plain, processor).add_inputs(collate(exps, 0), exps, 0)
        lp, _ = sharded_completion_logprobs(sharded, batch, chunk_size=3)
        want, _ = completion_logprobs(plain, batch)
        mask = batch["completion_mask"]
        (lp[mask].sum()).backward()
        (want[mask].sum()).backward()
        grad_err, trained = 0.0, 0
        for (_name, p), q in zip(sharded.named_parameters(), plain.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                trained += 1
                grad_err = max(grad_err, float((full_tensor(p.grad) - q.grad).abs().max()))
        units = {type(m).__name__.removeprefix("FSDP") for m in sharded.modules() if isinstance(m, FSDPModule)}
        results = {"logprob_err": float((lp - want).detach()[mask].abs().max()), "grad_err": grad_err,
                   "trained": trained, "units": sorted(units)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears its connections down while the other may still be finishing a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_sharded_vlm_logprobs_and_gradients_on_two_gloo_ranks(vlm_dir, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_vlm_sharded_worker, args=(str(tmp_path / "init"), str(vlm_dir), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["logprob_err"] < 1e-5 and r["grad_err"] < 1e-5 and r["trained"] > 0
        assert {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock", "Qwen2_5_VLForConditionalGeneration"} <= set(
            r["units"])


def test_the_shipped_vlm_config_checks_with_a_tiny_vlm(vlm_dir, squares, capsys):
    """``configs/grpo_vlm_qwen2_5_vl_3b.yaml`` as shipped (its judger, limits, rollout), on the tiny model and data."""
    from rlflow.data.check import main
    from tests.helpers.paths import ROOT

    code = main(["check", "--config", str(ROOT / "configs" / "grpo_vlm_qwen2_5_vl_3b.yaml"),
                 f"--model.model_path={vlm_dir}", f"--data.train_data_path={squares}",
                 f"--data.eval_data_path={squares}", "--data.global_batch_size=4"])  # 4 rows: one step's worth
    out = capsys.readouterr().out
    assert code == 0, out
    assert "judgers: * -> math" in out and "max_prompt_length 1536" in out

