"""Images of a prompt row: read the ``images`` (or ``image``) column, check each image, place them in the messages.

A row of a vision-language dataset carries its images beside the prompt, as TRL's VLM rows do: ``images`` (a list)
or ``image`` (one). Each image may be

* a path, relative to the data file's folder (or absolute, or ``~/...``);
* bytes (a parquet binary column), a ``datasets`` ``Image`` feature (a PIL image once decoded, or its
  ``{"bytes", "path"}`` dict undecoded), ``{"bytes": <base64 text>}`` in JSON, or a ``data:image/...;base64,`` URI.

URLs are refused: rlflow runs offline and never fetches data during training (download the images and give the
paths). Every image becomes an :data:`ImageRef`: an absolute path (``str``) or the encoded image (``bytes``),
plain types that a checkpoint's replay buffer stores under ``torch.load(weights_only=True)``; the pixels are
decoded again where they are needed (:mod:`rlflow.models.vision`).

The images are placed into the prompt the way Qwen2-VL-style processors expect (and TRL places them): one
``{"type": "image"}`` part per image at the start of the first user message, whose text becomes a
``{"type": "text"}`` part; the processor's chat template renders the parts and the processor expands each image
placeholder into the image's tokens, so image tokens count in the prompt length.

Simplifications: prompts with images must be chat messages (a plain-string prompt with images is an error);
messages whose content is already a list of parts are not accepted by the row check, so images cannot be
interleaved with text at chosen places; videos are not supported.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from rlflow.data.dataset import DataError, PromptRecord

#: One image of a prompt: an absolute path or the encoded image bytes.
ImageRef = str | bytes
IMAGE_COLUMNS = ("images", "image")
URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://")
MAX_ASPECT_RATIO = 200  # Qwen2-VL's resize refuses more elongated images


def pil_image() -> Any:
    """PIL's ``Image`` module, or an ImportError saying how to install it."""
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - the dev extra installs it
        raise ImportError("images need Pillow: pip install 'rlflow[vision]'") from exc
    return Image


def image_column(record: PromptRecord) -> str | None:
    """The name of the record's image column (``images`` or ``image``) if it holds any image, else None."""
    for name in IMAGE_COLUMNS:
        value = record.columns.get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 0):
            return name
    return None


def has_images(record: PromptRecord) -> bool:
    return record.images is not None or image_column(record) is not None


def data_file(record: PromptRecord) -> Path:
    """The file a record was read from (``record.source`` is ``file:line`` or ``file:row N``)."""
    return Path(record.source.rsplit(":", 1)[0])


def to_ref(value: Any, base_dir: Path, where: str) -> ImageRef:
    """One image value of a row as an :data:`ImageRef`; a DataError naming ``where`` (``file:line: field ...``)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray)):
            return bytes(data)
        if isinstance(data, str) and data:
            try:
                return base64.b64decode(data, validate=True)
            except ValueError as exc:
                raise DataError(f"{where}: 'bytes' is not base64 text: {exc}") from exc
        if isinstance(path, str) and path:
            return to_ref(path, base_dir, where)
        raise DataError(f"{where}: an image mapping needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise DataError(f"{where}: an empty string is not an image path")
        if text.startswith("data:"):
            head, _, payload = text.partition(",")
            if not head.endswith(";base64") or not payload:
                raise DataError(f"{where}: a data URI image must be 'data:image/<type>;base64,<data>'")
            try:
                return base64.b64decode(payload, validate=True)
            except ValueError as exc:
                raise DataError(f"{where}: the data URI is not valid base64: {exc}") from exc
        if text.lower().startswith(URL_SCHEMES):
            raise DataError(
                f"{where}: {text!r} is a URL; rlflow does not fetch images (training runs offline): download it and "
                "give the path, relative to the data file"
            )
        path = Path(text).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())
    Image = pil_image()
    if isinstance(value, Image.Image):  # a decoded ``datasets`` Image feature
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    raise DataError(
        f"{where}: an image must be a path, bytes, a data URI or a datasets Image, got {type(value).__name__}")


def image_refs(record: PromptRecord) -> list[ImageRef]:
    """The record's images as :data:`ImageRef` (cached on ``record.images``); DataError naming file:line and field."""
    if record.images is not None:
        return record.images
    name = image_column(record)
    if name is None:
        return []
    if "images" in record.columns and "image" in record.columns and record.columns["image"] is not None \
            and record.columns["images"] is not None:
        raise DataError(f"{record.source}: the row has both 'image' and 'images'; give its images in one of them")
    value = record.columns[name]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    base = data_file(record).parent
    refs = [to_ref(v, base, f"{record.source}: field '{name}[{j}]'" if isinstance(value, (list, tuple))
                   else f"{record.source}: field '{name}'") for j, v in enumerate(values)]
    record.images = refs
    record.columns[name] = refs  # judgers get images they can open: absolute paths or bytes
    return refs


def open_image(ref: ImageRef):
    """The image ``ref`` names, decoded, in RGB (what vision processors take)."""
    with pil_image().open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as img:
        img.load()
        return img.convert("RGB")


def describe(ref: ImageRef) -> str:
    return ref if isinstance(ref, str) else f"<{len(ref)} bytes>"


def check_image(ref: ImageRef, where: str) -> tuple[int, int]:
    """Open and decode one image; its ``(width, height)``, or a DataError saying what is wrong with it."""
    Image = pil_image()

    if isinstance(ref, str) and not Path(ref).is_file():
        raise DataError(f"{where}: image file {ref} not found" if not Path(ref).exists() else f"{where}: {ref} is "
                        "not a file")
    try:
        img = open_image(ref)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # UnidentifiedImageError is an OSError
        raise DataError(f"{where}: cannot decode image {describe(ref)}: {type(exc).__name__}: {exc}") from exc
    width, height = img.size
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise DataError(f"{where}: image {describe(ref)} is {width}x{height}; vision processors need both sides >= 1 "
                        f"and an aspect ratio of at most {MAX_ASPECT_RATIO}")
    return width, height


def check_images(record: PromptRecord) -> list[ImageRef]:
    """Every image of the record resolved, read and decoded (``rlflow data check``); the first problem raises."""
    refs = image_refs(record)
    name = image_column(record) or "images"
    for j, ref in enumerate(refs):
        check_image(ref, f"{record.source}: field '{name}[{j}]'")
    return refs


def with_image_parts(prompt: Any, count: int, where: str) -> list[dict[str, Any]]:
    """Chat messages with ``count`` image parts placed at the start of the first user message."""
    if not isinstance(prompt, list):
        raise DataError(f"{where}: field 'prompt' must be a list of chat messages when the row has images (the "
                        "processor's chat template places the images); got a plain string")
    messages, placed = [], False
    for message in prompt:
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        if not placed and message["role"] == "user":
            parts = [{"type": "image"} for _ in range(count)] + parts
            placed = True
        messages.append({**message, "content": parts})
    if not placed:
        raise DataError(f"{where}: field 'prompt' has no user message to place the row's images in")
    return messages
