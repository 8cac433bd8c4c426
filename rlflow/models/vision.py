"""Vision-language models: loading, the processor, images into prompts, rollouts and training forwards.

A model whose config has a ``vision_config`` (Qwen2-VL, Qwen2.5-VL, and the other image-text-to-text models of
transformers) is a VLM here. For it rlflow

* loads the policy and the reference with ``AutoModelForImageTextToText`` (:func:`model_auto_class`) and the
  processor with ``AutoProcessor`` (:func:`load_processor`), and freezes the vision tower unless
  ``model.policy.freeze_vision_tower: false`` (:func:`freeze_vision_tower`; :mod:`rlflow.models.loading` does
  both);
* renders each prompt with its images through the processor's chat template and tokenizes it with the processor,
  which expands every image placeholder into the image's tokens, so ``prompt_ids`` hold the image tokens and
  they count in ``data.max_prompt_length`` (:func:`encode_prompt`);
* hands the rollout backend :class:`ImagePrompt` s, lists of token ids (what every backend takes) that also
  carry the images; a backend declares :attr:`~rlflow.rollout.base.RolloutBackend.accepts_images` to be given
  them. ``hf`` passes the processed pixels to ``generate`` and never samples a vision placeholder token;
  ``engine`` refuses VLMs (``data.rollout=auto`` falls back to ``hf``); ``lmdeploy`` sends the images in its
  request;
* computes training log-probs with the images in context (:class:`VisionBatches`): each micro-batch's
  experiences keep their own images, re-processed from the stored references (paths or bytes, so the replay
  buffer and checkpoints hold plain types); only completion tokens are trained on, so image tokens never enter
  the loss, and a vision placeholder in a completion is masked out of it.

Simplifications: images only (no video); packed micro-batches are refused for VLMs (padded micro-batches are
used, with the reason logged), because packing would have to lay out each sequence's multimodal positions;
without torchvision (transformers' video processors need it) the processor is built from its image processor and
tokenizer alone (:func:`image_text_processor`), which covers everything rlflow uses.
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from rlflow.data.dataset import DataError, PromptFormat, PromptRecord
from rlflow.data.images import ImageRef, has_images, image_refs, open_image, with_image_parts

#: Module names of the vision encoder in transformers' VLMs (Qwen2/2.5-VL: ``visual``; LLaVA: ``vision_tower``).
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
#: Config attributes naming the vision placeholder tokens a completion must not contain.
PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                    "image_token_index")
ENGINE_REASON = ("it is a vision-language model ({name}): the engine decodes text-only prompts and does not run "
                 "the vision tower")
PACKING_REASON = ("it is a vision-language model ({name}): packs would need each sequence's multimodal positions "
                  "and images laid out per pack")


# ----------------------------------------------------------------------------------------------- models
def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def is_vision_model(model: Any) -> bool:
    """Whether ``model`` (a transformers model) has a vision encoder."""
    return is_vision_config(getattr(model, "config", None))


def model_auto_class(path: str) -> Any:
    """``AutoModelForImageTextToText`` for a VLM checkpoint, else ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception:  # from_pretrained raises the clearer error
        return AutoModelForCausalLM
    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder module of a VLM (the first module named one of :data:`VISION_TOWER_NAMES`)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_TOWER_NAMES:
            return module
    return None


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower (and its projector where it is part of it); the parameters frozen."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    params = list(tower.parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


def placeholder_ids(config: Any) -> list[int]:
    """Ids of the vision placeholder tokens (image pad, video pad, vision start/end) of a VLM config."""
    ids = {getattr(config, key, None) for key in PLACEHOLDER_KEYS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


# -------------------------------------------------------------------------------------------- processor
def image_text_processor(processor_class: type, image_processor: Any, tokenizer: Any, chat_template: str | None):
    """A ``processor_class`` (e.g. ``Qwen2_5_VLProcessor``) of an image processor and a tokenizer, without the
    video processor that its constructor requires and that transformers cannot build without torchvision.

    The class keeps ``processor_class``'s name, so what it saves reloads with ``AutoProcessor`` where torchvision
    is installed.
    """
    init = processor_class.__init__

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        init(self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs)

    cls = type(processor_class.__name__, (processor_class,), {"__init__": __init__,
                                                               "__module__": processor_class.__module__})
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def load_processor(path: str) -> Any | None:
    """The processor of a VLM checkpoint (``AutoProcessor``), or None for a text-only model.

    Without torchvision, ``AutoProcessor`` cannot build the video processor Qwen2-VL-style processors require (and a
    checkpoint saved by such a processor has no video processor config); the processor is then built from
    ``AutoImageProcessor`` and ``AutoTokenizer`` (:func:`image_text_processor`).
    """
    from transformers import AutoConfig, AutoProcessor
    from transformers.utils import is_torchvision_available

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception:
        return None
    if not is_vision_config(config):
        return None
    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as exc:
        try:
            return _image_text_processor_from(path)
        except Exception:
            if is_torchvision_available():
                raise exc from None
            raise


def _image_text_processor_from(path: str) -> Any:
    """:func:`image_text_processor` from a checkpoint's ``processor_config.json``, image processor and tokenizer."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    local = Path(path)
    saved = json.loads((local / "processor_config.json").read_text()) if (local / "processor_config.json").is_file() \
        else {}
    name = saved.get("processor_class")
    processor_class = getattr(transformers, name, None) if name else None
    if processor_class is None:
        raise DataError(f"{path}: cannot build the processor of this vision-language model without torchvision "
                        f"(processor_class {name!r}); pip install torchvision")
    template_file = local / "chat_template.jinja"
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = template_file.read_text() if template_file.is_file() else tokenizer.chat_template
    return image_text_processor(processor_class, AutoImageProcessor.from_pretrained(path), tokenizer, template)


def encode_prompt(record: PromptRecord, fmt: PromptFormat, processor: Any) -> tuple[str, list[int]]:
    """The rendered prompt (image placeholders not yet expanded) and its token ids with every image's tokens.

    The images are placed in the messages (:func:`rlflow.data.images.with_image_parts`) and rendered by the
    processor's chat template; the processor then expands the placeholders. DataError names file:line and field.
    """
    import dataclasses

    if processor is None:
        raise DataError(f"{record.source}: the row has images but the model is text-only (its checkpoint has no "
                        "vision config / processor); use a vision-language model or drop the images")
    refs = image_refs(record)
    text = fmt.render(dataclasses.replace(record, prompt=with_image_parts(record.prompt, len(refs), record.source)),
                      processor)
    try:
        images = [open_image(ref) for ref in refs]
        encoded = processor(text=[text], images=images or None)
    except Exception as exc:
        raise DataError(f"{record.source}: field 'images': the processor cannot process the row's images: "
                        f"{type(exc).__name__}: {exc}") from exc
    ids = encoded["input_ids"][0]
    return text, [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


class ImageInputs:
    """Processed pixel inputs of image lists (the image processor's tensors), with a small LRU cache so a group's
    images are processed about once per training pass rather than once per sequence.

    ``cache_size``: image lists kept (0: none). Each entry holds its images' float32 pixels, so the size bounds the
    host memory the cache takes.
    """

    def __init__(self, processor: Any, cache_size: int = 64) -> None:
        self.processor = processor
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()

    def __call__(self, refs: list[ImageRef]) -> dict[str, torch.Tensor]:
        key = tuple(refs)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        out = self.processor.image_processor(images=[open_image(r) for r in refs], return_tensors="pt")
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        self.cache[key] = tensors
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return tensors

    def batch(self, image_lists: list[list[ImageRef] | None]) -> dict[str, torch.Tensor]:
        """The inputs of several sequences' images, concatenated in sequence order (the order in which the model
        fills the image placeholders of a batch, row by row)."""
        parts = [self(images) for images in image_lists if images]
        if not parts:
            return {}
        return {key: torch.cat([p[key] for p in parts], dim=0) for key in parts[0]}


def token_type_ids(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``mm_token_type_ids`` (text 0, image 1, video 2) for models whose forward takes them (Qwen2-VL family: the
    multimodal rotary positions are computed from them); else nothing."""
    forward = getattr(model, "forward", None)
    if forward is None or "mm_token_type_ids" not in inspect.signature(forward).parameters:
        return {}
    config = model.config
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for value, key in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, key, None)
        if token is not None:
            types[input_ids == token] = value
    return {"mm_token_type_ids": types}


# ---------------------------------------------------------------------------------------------- rollout
class ImagePrompt(list):
    """A prompt's token ids (a ``list``, as every rollout backend takes prompts) that also carries its images.

    ``images``: the image references; ``text``: the prompt as rendered before the processor expanded the image
    placeholders (for servers that process images themselves); ``inputs``: the processed pixel tensors (for
    backends that run the Hugging Face model).
    """

    def __init__(self, ids: list[int], images: list[ImageRef], text: str = "",
                 inputs: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(ids)
        self.images, self.text, self.inputs = images, text, inputs or {}


def rollout_prompts(records: list[PromptRecord], image_inputs: ImageInputs | None = None) -> list[list[int]]:
    """What a rollout backend is given for ``records``: the token ids, as :class:`ImagePrompt` where a record has
    images (with their processed pixels when ``image_inputs`` is given)."""
    return [ImagePrompt(r.prompt_ids, r.images, r.prompt_text, image_inputs(r.images) if image_inputs else None)
            if r.images else r.prompt_ids for r in records]


def any_images(records: list[PromptRecord]) -> bool:
    return any(r.images for r in records)


def check_backend_accepts_images(backend: Any, records: list[PromptRecord]) -> None:
    """A ConfigError if the data has images and the rollout backend would drop them."""
    from rlflow.config_error import ConfigError

    if any_images(records) and not getattr(backend, "accepts_images", False):
        raise ConfigError(f"data.rollout: the {type(backend).__name__} backend does not take images, and the data "
                          "has prompts with images; use data.rollout=hf (or auto)")


def generation_inputs(model: Any, prompts: list[list[int]], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The vision keyword arguments of ``model.generate`` for one batch of prompts (empty for text-only ones)."""
    if not any(isinstance(p, ImagePrompt) and p.images for p in prompts):
        return {}
    parts = [p.inputs for p in prompts if isinstance(p, ImagePrompt) and p.images]
    if any(not part for part in parts):
        raise ValueError("an ImagePrompt reached the hf backend without processed pixels (rollout_prompts needs "
                         "the ImageInputs)")
    out = {key: torch.cat([p[key] for p in parts], dim=0) for key in parts[0]}
    return {**out, **token_type_ids(model, input_ids)}


# ---------------------------------------------------------------------------------------------- training
class VisionBatches:
    """Adds the images to collated (padded) micro-batches of a VLM's experiences.

    Args:
        model: The policy (its config names the placeholder tokens; its forward says whether it takes
            ``mm_token_type_ids``).
        processor: The policy's processor (:func:`load_processor`).
    """

    def __init__(self, model: Any, processor: Any) -> None:
        self.model = model
        self.images = ImageInputs(processor)
        self.placeholders = torch.tensor(placeholder_ids(model.config), dtype=torch.long)

    def add_inputs(self, batch: dict[str, torch.Tensor], experiences: list[Any], pad_id: int) -> dict:
        """``batch`` (from :func:`rlflow.data.experience.collate`) with each sequence's images in context.

        A completion token that is a vision placeholder is left out of ``completion_mask`` and replaced by
        ``pad_id`` in ``input_ids`` (the model would look for an image to put there). A batch with images loses
        its ``position_ids``: the model computes its own multimodal positions from the attention mask, the
        tokens and the image grids, as it does in ``generate``; a batch without images keeps them.
        """
        width = batch["completion_ids"].shape[1]
        stray = torch.isin(batch["completion_ids"], self.placeholders) & batch["completion_mask"]
        if stray.any():
            batch["completion_mask"] = batch["completion_mask"] & ~stray
            tail = batch["input_ids"][:, -width:]
            batch["input_ids"][:, -width:] = torch.where(stray, torch.full_like(tail, pad_id), tail)
        image_lists = [e.images for e in experiences]
        if not any(image_lists):
            return batch
        batch.update(self.images.batch(image_lists))
        batch.update(token_type_ids(self.model, batch["input_ids"]))
        batch.pop("position_ids", None)
        return batch


# ---------------------------------------------------------------------------------------------- checks
def image_prompt_length(record: PromptRecord, fmt: PromptFormat, processor: Any, tokenize: bool = True) -> int:
    """``rlflow data check``: validate the record's images (exist, decode, size) and return its prompt length in
    tokens, image tokens included (0 without ``tokenize``); DataError naming file:line and field."""
    from rlflow.data.images import check_images

    check_images(record)
    if not tokenize:
        return 0
    _, ids = encode_prompt(record, fmt, processor)
    return len(ids)


__all__ = [
    "ImageInputs", "ImagePrompt", "VisionBatches", "any_images", "check_backend_accepts_images", "encode_prompt",
    "freeze_vision_tower", "generation_inputs", "has_images", "image_prompt_length", "image_text_processor",
    "is_vision_model", "load_processor", "model_auto_class", "placeholder_ids", "rollout_prompts", "vision_tower",
]
