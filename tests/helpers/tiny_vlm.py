"""A tiny random-init Qwen2.5-VL model and processor built offline, and synthetic "count the squares" images.

The processor is a character tokenizer (``tokenizers``, as ``tools/make_tiny_model.py`` builds one) with Qwen's
vision special tokens and a Qwen2-VL-style chat template that renders ``{"type": "image"}`` parts, plus the
PIL backend of the Qwen2-VL image processor (no torchvision) with small ``min_pixels``/``max_pixels``, wrapped in
``Qwen2_5_VLProcessor`` without its video processor (:func:`rlflow.models.vision.image_text_processor`; transformers
builds video processors only with torchvision). Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import torch

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL = [PAD, IM_START, IM_END, UNK, *VISION]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
IMAGE_SIZE = 56  # 4 x 4 patches of 14 px, merged 2 x 2: 4 image tokens per image
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(set(string.printable) - {"\x0b", "\x0c", "\r"}):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, pad_token=PAD, eos_token=IM_END,
        additional_special_tokens=[IM_START, *VISION], padding_side="left", clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE, model_max_length=512,
    )


def build_processor():
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlflow.models.vision import image_text_processor  # Qwen2_5_VLProcessor wants a video processor: torchvision

    pixels = IMAGE_SIZE * IMAGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, size={"shortest_edge": pixels, "longest_edge": pixels},
        patch_size=14, merge_size=2, temporal_patch_size=2,
    )
    return image_text_processor(Qwen2_5_VLProcessor, image_processor, build_tokenizer(), CHAT_TEMPLATE)


def tiny_vlm(processor, seed: int = 0):
    """A 2-layer Qwen2.5-VL with a 1-block vision tower, random weights, in eval mode."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("image", "<|image_pad|>"), ("video", "<|video_pad|>"), ("start", "<|vision_start|>"),
            ("end", "<|vision_end|>"))}
    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 1, 1]},
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0], in_channels=3),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"], tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build(out: Path, seed: int = 0) -> Path:
    """Write the tiny model and its processor to ``out`` with ``save_pretrained``."""
    processor = build_processor()
    model = tiny_vlm(processor, seed)
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def squares_image(counts: dict[str, int], seed: int = 0):
    """A white ``IMAGE_SIZE`` square with ``counts[colour]`` small squares of each colour (non-overlapping)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    draw = ImageDraw.Draw(img)
    cells = rng.sample([(x, y) for x in range(0, IMAGE_SIZE - 7, 9) for y in range(0, IMAGE_SIZE - 7, 9)],
                       sum(counts.values()))
    for colour, n in counts.items():
        for _ in range(n):
            x, y = cells.pop()
            draw.rectangle([x, y, x + 6, y + 6], fill=COLOURS[colour])
    return img


def write_squares_data(root: Path, rows: int = 4, seed: int = 0, name: str = "train.jsonl") -> Path:
    """``rows`` prompts "How many red squares?" with a PNG each under ``root/images`` (paths relative to the file)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "images").mkdir(exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        counts = {c: rng.randint(0, 3) for c in COLOURS}
        squares_image(counts, seed + i).save(root / "images" / f"{i}.png")
        lines.append(json.dumps({
            "data_source": "squares", "prompt": [{"role": "user", "content": "How many red squares?"}],
            "images": [f"images/{i}.png"], "reward_model": {"ground_truth": str(counts["red"])},
        }))
    path = root / name
    path.write_text("\n".join(lines) + "\n")
    return path
