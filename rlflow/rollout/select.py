"""Choosing the rollout backend for a model: ``auto`` is the fast ``engine`` where it can run the model, else ``hf``.

Why a function and not an ``auto`` backend class: the choice needs the live model, which a backend only gets in
``bind``, and a proxy backend would have to forward the whole backend contract of the one it wraps
(:class:`~rlflow.rollout.base.RolloutBackend`: ``streams``/``stream`` for overlapped judging,
``generate(progress=...)``, ``reads_policy_weights``, ``sync_weights``).
:func:`resolve_backend` instead returns the chosen backend itself, already bound, so the rest of rlflow sees a
plain ``EngineRollout`` or ``HFRollout``. The engine decides what it supports (:meth:`EngineRollout.bind`
raises :class:`~rlflow.rollout.base.UnsupportedModelError` with the reason); this module only catches that and
logs the choice once, on rank 0 (:mod:`rlflow.log`). :meth:`RolloutDataModule.bind
<rlflow.data.datamodule.RolloutDataModule.bind>` calls it when it first builds the backend.

A backend named explicitly (``engine``, ``hf``, ``lmdeploy``, a ``class_path`` mapping, a built object) is built
and bound as named: an unsupported model is then an error, never a silent switch.
"""

from __future__ import annotations

from typing import Any

from rlflow import registry
from rlflow.log import info, warn
from rlflow.rollout.base import RolloutBackend, UnsupportedModelError

#: The ``data.rollout`` value that picks the backend from the model.
AUTO = "auto"


def resolve_backend(spec: Any, model: Any, tokenizer: Any) -> RolloutBackend:
    """Build the rollout backend ``spec`` names and bind it to ``model`` and ``tokenizer``.

    ``spec`` ``"auto"``: the ``engine`` backend (shared-prompt KV cache, continuous batching, fused decode) when
    it can run ``model``, otherwise ``hf`` (``model.generate``), with the reason logged as a warning. Any other
    spec goes through :func:`rlflow.registry.build` and is bound as is.
    """
    if spec != AUTO:
        backend = registry.build("rlflow.rollout", spec)
        backend.bind(model, tokenizer)
        return backend
    name = type(model).__name__
    engine = registry.build("rlflow.rollout", "engine")
    try:
        engine.bind(model, tokenizer)
    except UnsupportedModelError as exc:
        warn(f"data.rollout=auto: using the hf rollout backend for {name}, not the faster engine, "
             f"because {exc.reason}")
        backend = registry.build("rlflow.rollout", "hf")
        backend.bind(model, tokenizer)
        return backend
    path = engine.decode_path
    info(f"data.rollout=auto: using the engine rollout backend for {name}" + (f" ({path})" if path else ""))
    return engine
