"""LoRA adapters on the policy (``model.lora``), with PEFT: set-up, the frozen reference, checkpoints and exports.

Why: full fine-tuning keeps float32 master weights, their gradients and AdamW's two moments for every parameter;
with LoRA only the adapters carry gradients and optimizer state, and the base weights can stay in bfloat16
(PEFT keeps the adapters in float32: ``autocast_adapter_dtype``). The adapters are PEFT's own (``get_peft_model``);
this module only wires them into rlflow:

* **the policy stays the transformers model**: ``get_peft_model`` injects ``lora.Linear`` layers into it in place,
  and the :class:`~peft.PeftModel` wrapper is kept beside it (:func:`apply_lora`), so every code path that reads
  the policy (rollout backends, packing, FSDP2's per-layer sharding, log-probs) runs the adapted model unchanged;
* **the reference** of the KL term is the same model under ``PeftModel.disable_adapter()``, no second copy;
* **checkpoints** hold the trainable (adapter) tensors only (:func:`trainable_state`; the frozen base is filled
  back from the live model on load, :func:`complete_state`); the optimizer only ever sees adapter parameters;
* **exports** (at the end of ``fit`` and by ``rlflow export``, :mod:`rlflow.training.export`): the adapter with
  ``PeftModel.save_pretrained`` (loadable by ``PeftModel.from_pretrained``) and the merged model,
  ``merge_and_unload`` on a CPU copy of the base loaded from ``model.model_path`` with the adapter (loadable by
  ``AutoModelForCausalLM``);
* **rollout engines without adapters** get the deltas folded in: the ``engine`` backend's fused decoder reads
  each LoRA projection's effective weight (:func:`linear_weights`, PEFT's ``get_delta_weight``), and lmdeploy
  receives merged tensors (:func:`merge_lora_tensors`), as does the generator process of a pipelined or split
  rollout (:func:`rlflow.rollout.process.copy_weights`).

Simplifications: one adapter (PEFT's ``default``); the fused decoder and the merged push fold plain LoRA on
``nn.Linear`` only (DoRA and other variants, or LoRA on embeddings/LM head, make the engine decode through the
model's forward, and the lmdeploy push refuses them with a clear error; :func:`merge_problem` says why before the
run starts its generator process: ``data.pipeline.split_rollout`` goes off with the reason logged and
``data.pipeline.max_staleness > 0`` is refused in one line).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlflow.config_error import ConfigError

#: The LoraConfig fields :class:`LoraSettings` names itself (the rest go through ``options``).
NAMED_FIELDS = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
#: LoraConfig fields rlflow sets itself.
RESERVED_FIELDS = {"task_type", "peft_type", "inference_mode", "base_model_name_or_path", "revision"}


@dataclass
class LoraSettings:
    """``model.lora``: train PEFT LoRA adapters instead of the full weights (one GPU for a model whose full
    fine-tuning would not fit; see the README's LoRA section)."""

    r: int = 16
    """Rank of the adapters (PEFT's ``r``)."""
    alpha: float = 32.0
    """Scale numerator: the update is ``alpha / r * B @ A`` (PEFT's ``lora_alpha``; ``alpha / sqrt(r)`` with
    ``options.use_rslora``)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's ``lora_dropout``)."""
    target_modules: str | list[str] = "all-linear"
    """Modules to adapt: ``all-linear`` (every linear layer but the LM head), a list of names (``[q_proj,
    v_proj]``) or a regular expression."""
    options: dict[str, Any] = field(default_factory=dict)
    """Any other field of PEFT's ``LoraConfig`` (``use_rslora``, ``use_dora``, ``layers_to_transform``, ``bias``,
    ``init_lora_weights``, ...)."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ConfigError(f"model.lora.r must be an integer >= 1, got {self.r!r}")
        if not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ConfigError("model.lora.target_modules must name at least one module (or be 'all-linear')")

    @classmethod
    def coerce(cls, value: Any) -> LoraSettings | None:
        """``value`` as settings: None, a :class:`LoraSettings`, or a mapping of its fields (the Python API)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ConfigError(f"model.lora has no option {unknown[0]!r}; its options are "
                                  f"{', '.join(sorted(names))} (other LoraConfig fields go in model.lora.options)")
            return cls(**value)
        raise ConfigError(f"model.lora must be a mapping of {cls.__name__} fields or None, got {type(value).__name__}")

    def peft_config(self) -> Any:
        """PEFT's ``LoraConfig`` for a causal LM (a ConfigError naming the key for an unknown or invalid field)."""
        peft = require_peft()
        known = {f.name for f in dataclasses.fields(peft.LoraConfig)}
        for key in self.options:
            if key in NAMED_FIELDS:
                raise ConfigError(f"model.lora.options.{key}: set it as model.lora.{NAMED_FIELDS[key]}")
            if key in RESERVED_FIELDS:
                raise ConfigError(f"model.lora.options.{key} is set by rlflow (a causal-LM adapter)")
            if key not in known:
                raise ConfigError(f"model.lora.options.{key} is not a field of peft.LoraConfig "
                                  f"(peft {peft.__version__}); see its documentation for the fields")
        try:
            return peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                                   target_modules=self.target_modules, task_type="CAUSAL_LM", **self.options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model.lora: peft.LoraConfig rejects these settings: {exc}") from exc


def require_peft() -> Any:
    """The ``peft`` module, or a ConfigError saying how to install it."""
    try:
        import peft
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "peft":
            raise ConfigError("model.lora needs the PEFT library: pip install 'rlflow[lora]'") from exc
        raise _broken_peft(exc) from exc  # installed, but it does not import beside this transformers
    return peft


def _broken_peft(exc: ImportError) -> ConfigError:
    from rlflow.requirements import installed_version

    peft, transformers = (installed_version(name) or "?" for name in ("peft", "transformers"))
    return ConfigError(f"model.lora: the installed peft {peft} does not import beside transformers {transformers} "
                       f"({type(exc).__name__}: {exc}); install a peft release that supports it: pip install -U peft")


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """Inject LoRA adapters into ``model`` in place (only they stay trainable) and return PEFT's wrapper of it.

    ``model`` itself remains the module to run: ``wrapper.get_base_model() is model``.
    """
    peft = require_peft()
    config = settings.peft_config()
    try:
        wrapper = peft.get_peft_model(model, config)
    except ValueError as exc:  # e.g. target modules not found in the model
        raise ConfigError(f"model.lora: PEFT cannot adapt {type(model).__name__}: {exc}") from exc
    assert wrapper.get_base_model() is model
    return wrapper


def unwrap_peft(model: Any) -> Any:
    """The transformers model inside a PEFT ``PeftModel`` (whose attributes resolve one level too deep); any other
    model as it is."""
    get_base = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if get_base is not None and hasattr(model, "peft_config") else model


@contextlib.contextmanager
def adapters_disabled(wrapper: Any) -> Iterator[None]:
    """The base model for the block: ``PeftModel.disable_adapter()`` (the reference of the KL term)."""
    with wrapper.disable_adapter():
        yield


# ------------------------------------------------------------------------------------------- checkpoints
def frozen_keys(module: torch.nn.Module, prefix: str = "") -> set[str]:
    """``state_dict`` keys of ``module``'s parameters that do not train (the base weights under LoRA)."""
    return {prefix + name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trainable_state(state: dict[str, Any], frozen: set[str]) -> dict[str, Any]:
    """``state`` without the frozen keys: what a LoRA checkpoint holds (the adapters; buffers too)."""
    return {k: v for k, v in state.items() if k not in frozen}


def complete_state(state: dict[str, Any], live: dict[str, Any], frozen: set[str]) -> dict[str, Any]:
    """A LoRA checkpoint's ``state`` with the frozen tensors taken from the ``live`` model (they never change);
    a trainable key missing from the checkpoint stays missing (strict loading reports it)."""
    missing = {k: live[k] for k in frozen if k not in state and k in live}
    return {**state, **missing} if missing else state


# ---------------------------------------------------------------------------------------------- exports
def export_adapter(wrapper: Any, out_dir: Path, base_state: dict[str, torch.Tensor] | None = None) -> Path:
    """``PeftModel.save_pretrained`` of the adapter (``base_state``: the base model's gathered full weights, for
    a sharded model; None reads the live model)."""
    state = None if base_state is None else {"base_model.model." + k: v for k, v in base_state.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapper.save_pretrained(out_dir, state_dict=state)
    return out_dir


def export_merged(base: torch.nn.Module, adapter_dir: Path, out_dir: Path) -> Path:
    """Load the adapter written at ``adapter_dir`` onto ``base`` (a fresh copy of the base model),
    ``merge_and_unload`` it and ``save_pretrained`` the plain transformers model to ``out_dir``."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- engines without adapters
def lora_layer_types() -> tuple[type, ...]:
    """PEFT's LoRA layer classes (empty without PEFT installed)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return ()
    return (LoraLayer,)


def fold_problem(module: torch.nn.Module) -> str | None:
    """Why :func:`linear_weights` cannot give ``module``'s effective weight (None: a plain ``nn.Linear``, or a
    plain LoRA ``Linear`` over one)."""
    if type(module) is torch.nn.Linear:
        return None
    types = lora_layer_types()
    if not types or not isinstance(module, types):
        return f"a projection is a {type(module).__name__}, not a plain nn.Linear or a LoRA layer over one"
    if type(module.get_base_layer()) is not torch.nn.Linear:
        return f"a LoRA layer wraps a {type(module.get_base_layer()).__name__}, not a plain nn.Linear"
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if module.use_dora.get(name, False) or getattr(module, "lora_variant", {}).get(name) is not None:
            return "a LoRA layer uses a variant (DoRA, ...) whose effect is not a weight delta"
        if getattr(module, "lora_bias", {}).get(name, False):
            return "a LoRA layer has a trainable bias (lora_bias)"
    return None


def linear_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` that ``module`` applies: a plain ``nn.Linear``'s own, or for a LoRA layer its base
    weight plus PEFT's ``get_delta_weight`` of every active adapter (unless adapters are disabled or merged),
    in the base weight's dtype. A new tensor for a LoRA layer, the parameter itself otherwise."""
    problem = fold_problem(module)
    if problem:
        raise ValueError(problem)
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    base = module.get_base_layer()
    weight = base.weight
    if not module.disable_adapters and not module.merged:
        deltas = [module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A]
        if deltas:
            weight = weight + sum(deltas).to(weight.dtype)
    return weight, base.bias


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``model``'s PEFT LoRA layers by module name (none without PEFT installed)."""
    types = lora_layer_types()
    return {name: m for name, m in model.named_modules() if isinstance(m, types)} if types else {}


def merge_problem(model: torch.nn.Module) -> str | None:
    """Why :func:`merge_lora_tensors` cannot merge ``model``'s LoRA layers into plain weights, naming the first
    layer it cannot (``the LoRA layer NAME: WHY``), or None (no LoRA layers, or all plain LoRA on ``nn.Linear``).
    What needs the merged weights asks it before any of its slow work: the lmdeploy push, the generator process of
    a pipelined or split rollout (:mod:`rlflow.rollout.pipeline`, :mod:`rlflow.rollout.split`)."""
    for name, layer in lora_layers(model).items():
        problem = fold_problem(layer)
        if problem:
            return f"the LoRA layer {name}: {problem}"
    return None


def merge_lora_tensors(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s full ``(name, tensor)`` pairs (``state_dict`` order, full tensors) with each LoRA layer's
    adapters merged into its weight under the plain model's names (``q_proj.weight``, not
    ``q_proj.base_layer.weight`` + ``lora_A``/``lora_B``): what an inference engine without adapters loads.

    The merge is PEFT's formula, ``W + transpose(B @ A, fan_in_fan_out) * scaling`` per active adapter, computed
    in float32 and cast to ``W``'s dtype (``tests/test_lora.py`` checks it against ``merge_and_unload``). A
    model without LoRA layers passes through unchanged.
    """
    layers = lora_layers(model)
    if not layers:
        yield from named
        return
    problem = merge_problem(model)
    if problem:
        raise ValueError(f"cannot merge {problem} (the inference engine takes plain weights)")
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in named:
        parts = key.split(".")
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in layers),
                     None)
        if owner is None:
            yield key, tensor
            continue
        got = pending.setdefault(owner, {})
        got[key[len(owner) + 1:]] = tensor
        layer = layers[owner]
        adapters = [] if layer.disable_adapters or layer.merged else [
            a for a in layer.active_adapters if a in layer.lora_A]
        need = {"base_layer.weight"} | {f"lora_{ab}.{a}.weight" for a in layer.lora_A for ab in "AB"}
        if layer.get_base_layer().bias is not None:
            need.add("base_layer.bias")
        if not need <= got.keys():
            continue
        weight = got["base_layer.weight"]
        merged = weight.float()
        for a in adapters:
            delta = got[f"lora_B.{a}.weight"].float() @ got[f"lora_A.{a}.weight"].float()
            merged = merged + (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[a]
        yield f"{owner}.weight", merged.to(weight.dtype)
        if "base_layer.bias" in got:
            yield f"{owner}.bias", got["base_layer.bias"]
        del pending[owner]
    if pending:
        raise ValueError(f"incomplete LoRA tensors for {', '.join(sorted(pending))} in the model's state_dict")
