"""The prompt set: the configured sources read, rendered with the chat template, tokenized and length-filtered.

:class:`PromptSet` is the datamodule's first part. It knows how every source's prompts are rendered (the
data-level system prompt and template, or the source's own), drops (and counts) prompts over the length limit
rather than truncating them, remembers how many prompts each source kept, and builds the seeded batch sampler
over them: :class:`~rlflow.data.sampler.PromptBatchSampler` for one source, a weighted
:class:`~rlflow.data.mix.MixBatchSampler` for several.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from rlflow.config_error import ConfigError
from rlflow.data.dataset import DataError, PromptFormat, PromptRecord
from rlflow.data.images import has_images
from rlflow.data.mix import MixBatchSampler
from rlflow.data.sampler import PromptBatchSampler
from rlflow.data.sources import DataSource, read_source
from rlflow.log import info
from rlflow.models.vision import encode_prompt

T = TypeVar("T")


class PromptSet:
    """Prompts of one split (``train`` or ``eval``), ready for generation.

    Args:
        sources: The split's sources (:func:`rlflow.data.sources.parse_sources`).
        split: ``train`` or ``eval``; names the split in messages.
        max_prompt_length: Prompts longer than this many tokens are dropped (a source may set its own limit).
        system_prompt: If set, replaces (or adds) the system message of every chat prompt.
        prompt_template: If set, plain-string prompts become ``prompt_template.format(prompt=..., **columns)``.
        chat_template_kwargs: Extra keyword arguments for the chat template.
    """

    def __init__(self, sources: list[DataSource], split: str, max_prompt_length: int, system_prompt: str | None = None,
                 prompt_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.sources = sources
        self.split = split
        self.max_prompt_length = max_prompt_length
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        try:  # a bad template fails here, before any model is loaded
            PromptFormat(prompt_template=prompt_template)
        except ValueError as exc:
            raise ConfigError(str(exc).replace("prompt_template", "data.prompts.template", 1)) from exc
        self.records: list[PromptRecord] = []
        self.sizes: dict[str, int] = {}  # prompts kept per source name
        self.dropped_by_source: dict[str, int] = {}

    @property
    def dropped(self) -> int:
        """Prompts dropped for their length, over all sources."""
        return sum(self.dropped_by_source.values())

    def format_for(self, source: DataSource | None = None) -> PromptFormat:
        """How the prompts of ``source`` are rendered: its own system prompt / template, else the data-level ones."""
        system = self.system_prompt if source is None or source.system_prompt is None else source.system_prompt
        template = self.prompt_template if source is None or source.prompt_template is None else source.prompt_template
        return PromptFormat(system, template, self.chat_template_kwargs)

    def load(self, tokenizer: Any, processor: Any = None) -> list[PromptRecord]:
        """Read, render and tokenize every prompt of every source (once); drop those over the length limit.

        ``processor``: a vision-language model's processor; rows with images are rendered and tokenized by it, image
        tokens included (:func:`rlflow.models.vision.encode_prompt`).
        """
        if self.records:
            return self.records
        kept: list[PromptRecord] = []
        self.sizes, self.dropped_by_source = {}, {}
        for source in self.sources:
            fmt = self.format_for(source)
            limit = source.max_prompt_length or self.max_prompt_length
            if source.max_prompt_length:
                setting = f"{source.name}.max_prompt_length={limit}"
            else:
                setting = f"data.max_prompt_length={limit}"
            n_kept = n_dropped = 0
            for record in read_source(source):
                if has_images(record):  # a vision-language row: rlflow.models.vision
                    record.prompt_text, record.prompt_ids = encode_prompt(record, fmt, processor)
                else:
                    record.prompt_text = fmt.render(record, tokenizer)
                    record.prompt_ids = tokenizer(record.prompt_text, add_special_tokens=False)["input_ids"]
                if len(record.prompt_ids) > limit:
                    n_dropped += 1
                    continue
                kept.append(record)
                n_kept += 1
            if n_dropped:
                info(f"{self.split}: dropped {n_dropped} prompt(s) of {source.name} longer than {setting} tokens")
            if not n_kept:
                raise DataError(
                    f"no usable {self.split} prompts in {source.path}: all {n_dropped} are longer than {setting}"
                )
            self.sizes[source.name] = n_kept
            self.dropped_by_source[source.name] = n_dropped
        self.records = kept
        return kept

    def sampler(self, global_batch_size: int, seed: int,
                skip_solved: bool = False) -> PromptBatchSampler | MixBatchSampler:
        """The seeded batch sampler over :attr:`records`: one batch of prompt indices per rollout step
        (``skip_solved``: leaving solved prompts out of later epochs, one source only)."""
        if len(self.sources) > 1:  # several sources: each gets its weight's share of every batch
            if skip_solved:
                raise ConfigError("data.filtering.skip_solved works with one training source; a weighted mix of "
                                  "sources is not filtered (set data.filtering.skip_solved=false)")
            return MixBatchSampler([self.sizes[s.name] for s in self.sources], [s.weight for s in self.sources],
                                   global_batch_size, seed=seed, names=[s.name for s in self.sources])
        return PromptBatchSampler(len(self.records), global_batch_size, seed=seed, skip_solved=skip_solved)


def prompt_key(text: str) -> int:
    """What an eval prompt is matched to the train prompts by: the prompt as the model sees it (rendered with its
    chat template and system prompt), hashed. Rows with images have none: their text alone does not tell them
    apart. ``rlflow fit`` (:func:`shared_prompts`) and ``rlflow data check`` both match by it."""
    return hash(text)


def shared_items(train_keys: set[int], held_out: Iterable[tuple[int, T]]) -> list[T]:
    """The items of ``held_out`` (``(prompt_key, item)`` pairs, in order) whose key is one of ``train_keys``."""
    return [item for key, item in held_out if key in train_keys]


def shared_prompts(train: list[PromptRecord], held_out: list[PromptRecord]) -> list[PromptRecord]:
    """The records of ``held_out`` whose prompt (:func:`prompt_key`) is also a prompt of ``train``; records with
    images are never shared."""
    keys = {prompt_key(r.prompt_text) for r in train if not has_images(r)}
    return shared_items(keys, ((prompt_key(r.prompt_text), r) for r in held_out if not has_images(r)))
