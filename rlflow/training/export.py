"""Hugging Face exports of the policy: at the end of ``fit`` (``model.export_hf``) and from any checkpoint
(``rlflow export``).

``rlflow export --ckpt_path runs/x/version_0/checkpoints/last.ckpt --out exported [--lora merged|adapter|both]``
reads the checkpoint's hyper-parameters (``model.model_path``, ``model.policy``, ``model.lora``), builds the
policy as the run did (:func:`rlflow.models.loading.build_policy`), loads the checkpoint's weights into it
(``torch.load(weights_only=True)``; an FSDP2 checkpoint folder is read with ``torch.distributed.checkpoint``) and
writes it with ``save_pretrained``, beside the tokenizer (a vision-language model's processor).

Where the exports go (:meth:`PolicyExport.write`):

* full fine-tuning: the model in ``--out`` (at the end of ``fit``: ``<log_dir>/hf``);
* ``model.lora``: ``merged`` writes the merged model (``merge_and_unload`` of the adapter on a fresh copy of
  the base from ``model.model_path``, loadable with ``AutoModelForCausalLM``) to ``--out``; ``adapter`` writes
  the adapter (``PeftModel.save_pretrained``, loadable with ``PeftModel.from_pretrained``) to ``--out``;
  ``both`` (the default, and what ``fit`` writes to its log directory) writes ``<out>/hf`` and
  ``<out>/hf_adapter``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlflow.config_error import ConfigError
from rlflow.log import info

LORA_MODES = ("merged", "adapter", "both")


@dataclass
class PolicyExport:
    """A policy and what its exports need beside it."""

    policy: torch.nn.Module
    """The transformers model (under LoRA: with the adapters injected)."""
    processor: Any
    """What is saved beside the weights: a VLM's processor (it holds the tokenizer), else the tokenizer."""
    model_path: str
    """The base model (``model.model_path``): a LoRA merge loads a fresh copy of it."""
    settings: Any
    """The ``model.policy`` settings (:class:`~rlflow.training.settings.PolicySettings`): the base's dtype."""
    peft: Any = None
    """PEFT's wrapper of the policy under ``model.lora``."""

    def write(self, out: Path, lora: str | None = None, state_dict: dict[str, Any] | None = None) -> list[Path]:
        """Write the exports to ``out`` (see the module docstring; ``lora``: one of :data:`LORA_MODES`, None for
        ``both``); ``state_dict``: the policy's gathered full weights (a sharded run), None reads the live model.
        The directories written."""
        if self.peft is None:
            if lora is not None:
                raise ConfigError("--lora applies to a model.lora run; this one trained the full weights")
            return [self.write_model(out, state_dict)]
        lora = lora or "both"
        if lora not in LORA_MODES:
            raise ConfigError(f"--lora must be one of {', '.join(LORA_MODES)}, got {lora!r}")
        if lora == "adapter":
            return [self.write_adapter(out, state_dict)]
        if lora == "merged":
            with tempfile.TemporaryDirectory() as tmp:
                return [self.write_merged(self.write_adapter(Path(tmp) / "adapter", state_dict, quiet=True), out)]
        adapter = self.write_adapter(out / "hf_adapter", state_dict)
        return [self.write_merged(adapter, out / "hf"), adapter]

    def write_model(self, out: Path, state_dict: dict[str, Any] | None = None) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(out, state_dict=state_dict)
        self.processor.save_pretrained(out)
        info(f"exported the policy to {out}")
        return out

    def write_adapter(self, out: Path, state_dict: dict[str, Any] | None = None, quiet: bool = False) -> Path:
        from rlflow.models.lora import export_adapter

        base = str(Path(self.model_path).resolve()) if Path(self.model_path).is_dir() else self.model_path
        for config in self.peft.peft_config.values():  # a relative path would load only from the run's folder
            config.base_model_name_or_path = base
        export_adapter(self.peft, out, state_dict)
        self.processor.save_pretrained(out)
        if not quiet:
            info(f"exported the LoRA adapter to {out}")
        return out

    def write_merged(self, adapter_dir: Path, out: Path) -> Path:
        from rlflow.models.loading import load_causal_lm
        from rlflow.models.lora import export_merged

        base = load_causal_lm(self.model_path, self.settings.dtype, self.settings.attn_implementation)
        export_merged(base, adapter_dir, out)
        self.processor.save_pretrained(out)
        info(f"exported the merged policy (base + LoRA adapter) to {out}")
        return out


# ------------------------------------------------------------------------------------------ checkpoints
def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters`` and ``state_dict``: a file with ``torch.load(weights_only=True)``, or
    an FSDP2 (distributed) checkpoint folder, whose shards ``torch.distributed.checkpoint`` joins."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--ckpt_path {path} does not exist")
    if path.is_file():
        checkpoint = load_file(path)
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
            raise ConfigError(f"--ckpt_path {path} is not a checkpoint of rlflow fit (it holds no state_dict)")
        return checkpoint
    meta = path / "meta.pt"
    if not meta.is_file():
        raise ConfigError(f"--ckpt_path {path} is a folder but not a distributed checkpoint (no meta.pt in it)")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = load_file(meta)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "joined.pt")
        checkpoint["state_dict"] = torch.load(Path(tmp) / "joined.pt", map_location="cpu",
                                              weights_only=True)["state_dict"]
    return checkpoint


ZIP_MAGIC = b"PK\x03\x04"


def load_file(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of the checkpoint file at ``path``; a ConfigError, one line naming the file,
    where it is not a readable checkpoint: truncated (a zip archive without its end), not a checkpoint at all, or
    corrupt. A whole checkpoint that holds more than tensors and plain values is refused as ``rlflow fit`` refuses
    it (:mod:`rlflow.training.safe_load`), never with torch's advice to read it with ``weights_only=False``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read the file is said in one line
        if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):
            from rlflow.training.safe_load import _refusal

            raise _refusal(path, exc) from exc
        raise ConfigError(f"--ckpt_path {path} is not a readable rlflow checkpoint: {unreadable(path, exc)}") \
            from exc


def unreadable(path: Path, exc: BaseException) -> str:
    """Why the file at ``path`` did not load (:func:`load_file`): truncated, not a checkpoint, or corrupt."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError as error:
        return f"cannot open the file ({error.strerror or error})"
    size = path.stat().st_size
    if head == ZIP_MAGIC and not zipfile.is_zipfile(path):
        return f"the file is truncated ({size} bytes of a zip archive without its end: an interrupted write or copy)"
    if not zipfile.is_zipfile(path):
        return f"the file is not a checkpoint ({size} bytes, not the zip archive torch.save writes)"
    text = str(exc).split("WeightsUnpickler error:", 1)[-1]  # not torch's advice to load with weights_only=False
    reason = (text.strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:160]
    return f"the file is corrupt ({reason})"


def policy_weights(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's tensors of a ``GRPOModule`` state dict (``policy.`` keys, the prefix removed)."""
    return {key[len("policy."):]: value for key, value in state_dict.items() if key.startswith("policy.")}


def load_policy_weights(policy: torch.nn.Module, weights: dict[str, torch.Tensor], lora: bool) -> None:
    """Load a checkpoint's policy ``weights`` into ``policy``. Every tensor must fit; under LoRA the checkpoint
    holds the trainable (adapter) tensors and the base weights stay those of ``model.model_path``, which training
    never changes (:func:`rlflow.models.lora.trainable_state`)."""
    from rlflow.models.lora import frozen_keys

    missing, unexpected = policy.load_state_dict(weights, strict=False)
    if lora:
        missing = sorted(set(missing) - frozen_keys(policy))
    if missing or unexpected:
        raise ConfigError(f"the checkpoint's weights do not fit the policy built from its hyper-parameters: "
                          f"missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]}")


def text_processor(path: str) -> Any:
    """A vision-language model's processor, else the tokenizer, of the model at ``path``."""
    from transformers import AutoTokenizer

    from rlflow.models.vision import load_processor

    return load_processor(path) or AutoTokenizer.from_pretrained(path)


def export_checkpoint(
    ckpt_path: str | os.PathLike, out: str | os.PathLike, lora: str | None = None, model_path: str | None = None
) -> list[Path]:
    """``rlflow export``: the policy of the checkpoint at ``ckpt_path`` written to ``out`` (see the module
    docstring). ``model_path`` replaces the checkpoint's ``model.model_path`` (a base model that moved)."""
    from rlflow.models.loading import build_policy
    from rlflow.models.lora import LoraSettings
    from rlflow.training.settings import PolicySettings, grouped_hparams

    checkpoint = read_checkpoint(ckpt_path)
    hparams = grouped_hparams(checkpoint.get("hyper_parameters") or {})
    model_path = model_path or run_model_path(hparams.get("model_path"), ckpt_path)
    if not model_path:
        raise ConfigError(f"{ckpt_path}: the checkpoint's hyper-parameters name no model.model_path; pass "
                          "--model_path")
    settings = PolicySettings.coerce(hparams.get("policy"))
    lora_settings = LoraSettings.coerce(hparams.get("lora"))
    if lora is not None and lora_settings is None:
        raise ConfigError(f"--lora applies to a model.lora run; {ckpt_path} trained the full weights")
    check_out(Path(out), model_path)
    models = build_policy(model_path, settings, lora_settings, training=False)
    load_policy_weights(models.policy, policy_weights(checkpoint["state_dict"]), lora_settings is not None)
    models.policy.eval()
    export = PolicyExport(models.policy, text_processor(model_path), model_path, settings, models.peft)
    return export.write(Path(out), lora)


def check_out(out: Path, model_path: str) -> None:
    """``--out`` as a directory the export can write, and not the base model's own (which it would overwrite);
    created here, before the model loads."""
    if out.is_file():
        raise ConfigError(f"--out {out} is a file; give a directory to write the model into")
    base = Path(model_path).expanduser()
    if base.is_dir() and out.is_dir() and out.resolve() == base.resolve():
        raise ConfigError(f"--out {out} is the base model's own directory (model.model_path), which the export "
                          "would overwrite; give another directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be created: {exc.strerror or exc}") from exc


def run_model_path(model_path: str | None, ckpt_path: str | Path) -> str | None:
    """The run's ``model.model_path`` as this process can load it. A path relative to where the run was started
    (``checkpoints/tiny-qwen3``) is looked for from here, then from each folder above the checkpoint (a run's
    checkpoints lie under ``<where it started>/runs/...``); a local model is returned absolute, so that an
    exported adapter names a base model that loads from anywhere on this machine. A hub id is returned as it is."""
    if not model_path or Path(model_path).is_absolute():
        return model_path
    candidates = [Path(model_path), *(parent / model_path for parent in Path(ckpt_path).resolve().parents)]
    found = next((c for c in candidates if (c / "config.json").is_file()), None)
    if found is not None:
        return str(found.resolve())
    from rlflow.models.model_path import looks_local

    if looks_local(model_path):
        raise ConfigError(f"{ckpt_path}: its run's model.model_path {model_path!r} (relative to where the run "
                          "started) is neither here nor above the checkpoint; pass --model_path")
    return model_path  # owner/name: a hub id


def main(argv: list[str] | None = None) -> int:
    """The ``rlflow export`` command."""
    parser = argparse.ArgumentParser(
        prog="rlflow export", description="Write a checkpoint's policy as a Hugging Face model (save_pretrained) "
        "with its tokenizer; a LoRA run's merged model and/or adapter.")
    parser.add_argument("--ckpt_path", required=True, help="A checkpoint of rlflow fit (last.ckpt, a step "
                        "checkpoint, or an FSDP2 checkpoint folder).")
    parser.add_argument("--out", required=True, help="Output directory.")
    parser.add_argument("--lora", choices=LORA_MODES, default=None,
                        help="LoRA runs: the merged model, the adapter, or both (<out>/hf and <out>/hf_adapter; "
                        "the default).")
    parser.add_argument("--model_path", default=None, help="The base model, if not where the checkpoint's "
                        "model.model_path says.")
    args = parser.parse_args(argv)
    try:
        export_checkpoint(args.ckpt_path, args.out, args.lora, args.model_path)
    except (ConfigError, FileNotFoundError) as exc:
        if os.environ.get("RLFLOW_TRACEBACK"):
            raise
        print(f"rlflow: error: {exc}\n(set RLFLOW_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        return 1
    return 0
