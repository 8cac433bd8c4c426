"""The plugin registry: judgers, losses, advantage estimators and rollout backends found through entry points.

Built-ins register through rlflow's own ``pyproject.toml``, the same path a third-party package uses, so a
``pip install`` of a plugin package plus one YAML line is all it takes to use it. Each group is read once per
process (every distributed rank reads it; reading is idempotent) and cached.

A plugin is named in a config by its short name (``gsm8k``), by an import path (``pkg.mod:attr``), by a
``{"class_path": ..., "init_args": {...}}`` mapping, or, from Python, passed as a ready object. Errors are loud
and specific: an unknown name lists what is available, a plugin whose import fails names its distribution and
chains the exception, and two distributions claiming one name is an error naming both.

Typed plugin arguments. The plugin arguments of ``GRPOModule`` and ``RolloutDataModule`` are annotated
``str | <base class>`` (``PolicyLoss``, ``AdvantageEstimator``, ``RolloutBackend``, ``Judger``; see
:data:`PLUGIN_BASES`), Lightning's convention, so jsonargparse validates a ``class_path``/``init_args`` mapping
against the class's signature, instantiates it, and ``rlflow fit --model.loss.help grpo`` prints its options.
A plain string stays a string and :func:`build` resolves it (short name or import path, which keeps TRL-style
reward functions given by import path working). jsonargparse resolves a ``class_path`` without a dot by the
class *name* of a known subclass (``GRPOLoss``); :func:`install_jsonargparse_resolver` (called by
``rlflow.cli``) wraps that one resolution step so that, for these four base classes, a registered short name
(``class_path: grpo``, third-party entry points included) resolves to its entry point's import path first, and
a dotless name that is neither a short name nor a subclass name fails with :func:`build`'s "unknown plugin"
error listing what is available. It is the only jsonargparse internal rlflow touches
(``jsonargparse._typehints.resolve_class_path_by_name``, stable since 4.20); ``tests/test_registry.py``
fails if a jsonargparse release changes it. :func:`build` accepts the objects jsonargparse instantiates as
they are; :func:`init_defaults` and :func:`apply_settings` let the CLI put settings that live elsewhere in the
config (``data.sampling.max_tokens``) into a mapping's ``init_args`` before it is
instantiated.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUPS = (
    "rlflow.judgers",
    "rlflow.losses",
    "rlflow.advantages",
    "rlflow.rollout",
    "rlflow.tools",
    "rlflow.tool_parsers",
    "rlflow.environments",
)
#: The base class (import path) a plugin argument of each group is typed with; see the module docstring.
PLUGIN_BASES = {
    "rlflow.judgers": "rlflow.judgers.base.Judger",
    "rlflow.losses": "rlflow.losses.base.PolicyLoss",
    "rlflow.advantages": "rlflow.advantages.base.AdvantageEstimator",
    "rlflow.rollout": "rlflow.rollout.base.RolloutBackend",
}


class PluginError(RuntimeError):
    """A plugin could not be found, loaded or built."""


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin: its short name, where it lives and which distribution ships it."""

    group: str
    name: str
    value: str
    distribution: str
    version: str
    entry_point: EntryPoint


_lock = threading.Lock()
_cache: dict[str, dict[str, PluginInfo]] = {}
_loaded: dict[tuple[str, str], Any] = {}
_conflicts: dict[str, dict[str, str]] = {}  # group -> name -> why two distributions make it unusable


def _check_group(group: str) -> str:
    if group not in GROUPS:
        raise PluginError(f"unknown plugin group {group!r}; the groups are: {', '.join(GROUPS)}")
    return group


def discover(group: str) -> dict[str, PluginInfo]:
    """Return every plugin of ``group`` by short name, reading the entry points once per process."""
    _check_group(group)
    with _lock:
        if group in _cache:
            return _cache[group]
        found: dict[str, PluginInfo] = {}
        for ep in entry_points(group=group):
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
            version = dist.version if dist is not None else "?"
            info = PluginInfo(group, ep.name, ep.value, dist_name, version, ep)
            if ep.name in found and (found[ep.name].distribution, found[ep.name].value) != (dist_name, ep.value):
                other = found[ep.name]  # an error where the name is used; the group's other plugins still work
                _conflicts.setdefault(group, {})[ep.name] = (
                    f"two distributions claim the {group} plugin {ep.name!r}: "
                    f"{other.distribution} {other.version} ({other.value}) and {dist_name} {version} ({ep.value}); "
                    "uninstall one of them, or name the one you mean by its import path"
                )
                continue
            found[ep.name] = info
        _cache[group] = found
        return found


def available(group: str) -> list[str]:
    """Sorted short names registered in ``group``."""
    return sorted(discover(group))


def conflict(group: str, name: str) -> str | None:
    """Why ``name`` cannot be used in ``group`` (two distributions register it), or None."""
    discover(group)
    return _conflicts.get(group, {}).get(name)


def misplaced(group: str, name: str) -> list[tuple[str, str]]:
    """``(entry-point group, distribution)`` of each registration of ``name`` in an ``rlflow...`` group that rlflow
    does not read (``rlflow.judger`` for ``rlflow.judgers``, say)."""
    out = []
    for other in sorted(entry_points().groups):
        if other.startswith("rlflow") and other not in GROUPS:
            for ep in entry_points(group=other):
                if ep.name == name:
                    dist = getattr(ep, "dist", None)
                    out.append((other, dist.metadata["Name"] if dist is not None else "<unknown>"))
    return out


def _unknown(group: str, name: str) -> PluginError:
    names = ", ".join(available(group)) or "(none)"
    elsewhere = "".join(f"; {dist} registers {name!r} in the entry-point group {other!r}, which rlflow does not "
                        f"read: the group is {group!r}" for other, dist in misplaced(group, name))
    return PluginError(
        f"unknown {group} plugin {name!r}{elsewhere}; available: {names} "
        "(or give an import path 'package.module:attribute'; `rlflow plugins` lists what is installed)"
    )


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is an import path (``pkg.mod:attr`` or ``pkg.mod.attr``) rather than a short name."""
    return ":" in name or "." in name


def load(group: str, name: str) -> Any:
    """Import and return the object (usually a class or function) registered as ``name`` in ``group``."""
    plugins = discover(group)
    why = conflict(group, name)
    if why is not None:
        raise PluginError(why)
    if name not in plugins:
        raise _unknown(group, name)
    key = (group, name)
    with _lock:
        if key in _loaded:
            return _loaded[key]
    info = plugins[name]
    try:
        obj = info.entry_point.load()
    except (Exception, SystemExit) as exc:  # a broken plugin must fail loudly, naming where it came from
        raise PluginError(
            f"the {group} plugin {name!r} ({info.value}) from distribution {info.distribution} {info.version} "
            f"failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    with _lock:
        _loaded[key] = obj
    return obj


def import_path(path: str) -> Any:
    """Import ``pkg.mod:attr`` or ``pkg.mod.attr``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{path!r} is not an import path of the form 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # a module calling sys.exit() as it loads, too
        raise PluginError(f"could not import module {module_name!r} for {path!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from exc
    return obj


def _mapping_from_text(group: str, text: str) -> Any:
    """A ``{class_path: ..., init_args: ...}`` given on the command line that jsonargparse did not accept reaches
    the plugin argument as its text (the ``str`` of ``str | Base``); read it, so its error is the registry's."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PluginError(f"the {group} plugin {text!r} is neither a name nor a valid mapping: {exc}") from exc


def refused_plugin(group: str, mapping: dict[str, Any]) -> str | None:
    """Why the parser refused a mapping of ``group``'s plugins given as text on the command line
    (``--data.judging.judgers '{"*": {"class_path": ..., "init_args": {...}}}'``, which reaches :func:`build` as
    its text when one plugin in it does not validate): the first plugin's error, as jsonargparse reports it for
    that plugin alone (``data.judging.judgers['*'].init_args.timeout: expected float, got abc``); None if every
    plugin in it validates."""
    import importlib
    import json

    from jsonargparse import ArgumentParser

    from rlflow.config_parse_errors import parse_error_line

    if group not in PLUGIN_BASES:
        return None
    module, _, name = PLUGIN_BASES[group].rpartition(".")
    base = getattr(importlib.import_module(module), name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--plugin", type=base)
    for key, specs in mapping.items():
        for spec in specs if isinstance(specs, list) else [specs]:
            if not isinstance(spec, dict):
                continue
            try:
                parser.parse_args(["--plugin", json.dumps(spec)])
            except Exception as exc:  # noqa: BLE001 - jsonargparse's parse errors, reported as one line
                option = "data.judging.judgers" if group == "rlflow.judgers" else group
                line = parse_error_line(str(exc), [], []).replace("plugin.", f"{option}[{key!r}].")
                return f"command line: {option}[{key!r}]{line.removeprefix('plugin')}" if line.startswith(
                    "plugin:") else f"command line: {line}"
    return None


def resolve_spec(group: str, spec: str | dict) -> tuple[Any, dict[str, Any]]:
    """The plugin object (class or function) a name, import path or ``{"class_path", "init_args"}`` mapping names
    (mapping text already read), and its ``init_args``; PluginError when it cannot be found or is malformed."""
    if isinstance(spec, str):
        return (load(group, spec) if spec in discover(group) or not looks_like_path(spec) else import_path(spec)), {}
    unknown = set(spec) - {"class_path", "init_args"}
    if "class_path" not in spec or unknown:
        raise PluginError(
            f"a {group} plugin mapping needs 'class_path' (and optionally 'init_args'); got keys {sorted(spec)}"
        )
    cp = spec["class_path"]
    if not isinstance(cp, str):
        raise PluginError(f"the {group} plugin's class_path must be a string, got {cp!r}")
    target = load(group, cp) if cp in discover(group) or not looks_like_path(cp) else import_path(cp)
    if not isinstance(spec.get("init_args") or {}, dict):
        raise PluginError(f"the {group} plugin {cp!r} has init_args {spec['init_args']!r}; it must be a mapping")
    return target, dict(spec.get("init_args") or {})


def check_spec(group: str, spec: str) -> None:
    """Resolve ``spec`` (a name, an import path or mapping text) and check its ``init_args`` names against the
    plugin's signature, without building it: PluginError on an unknown plugin or argument (for plugins built late,
    e.g. a rollout backend built once the policy has loaded)."""
    parsed = _mapping_from_text(group, spec) if spec.lstrip().startswith("{") else spec
    target, init_args = resolve_spec(group, parsed)
    if isinstance(target, type):
        params = inspect.signature(target).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            unknown = sorted(set(init_args) - set(params))
            if unknown:
                name = parsed["class_path"] if isinstance(parsed, dict) else parsed
                raise PluginError(
                    f"{group} plugin {name!r} has no argument {', '.join(map(repr, unknown))}; its "
                    f"arguments: {', '.join(n for n in params if n != 'self')}"
                )


def build(group: str, spec: Any, **defaults: Any) -> Any:
    """Turn a config value into a plugin object.

    ``spec`` is a short name or an import path (``pkg.mod:attr``), a ``{"class_path", "init_args"}`` mapping
    (``class_path`` is a short name or an import path; also as YAML text), or an object that is already built,
    such as one jsonargparse instantiated from the config (returned as is). A
    registered short name wins over an import path of the same spelling. A loaded class is called with
    ``init_args``; ``defaults`` fill arguments the config did not set and that the class accepts. A loaded
    function (a TRL-style reward function, say) is returned as is.
    """
    if spec is None:
        raise PluginError(f"no {group} plugin given; available: {', '.join(available(group)) or '(none)'}")
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        spec = _mapping_from_text(group, spec)
        if isinstance(spec, dict) and "class_path" not in spec:  # a mapping of plugins the parser refused
            problem = refused_plugin(group, spec)
            if problem is not None:
                raise PluginError(problem)
    if not isinstance(spec, (str, dict)):
        return spec
    target, init_args = resolve_spec(group, spec)
    if isinstance(target, type):
        params = inspect.signature(target).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for key, value in defaults.items():
            if key not in init_args and (takes_kwargs or key in params):
                init_args[key] = value
        try:
            return target(**init_args)
        except TypeError as exc:
            raise PluginError(f"could not build {group} plugin {spec!r}: {exc}") from exc
    if init_args:
        raise PluginError(f"{group} plugin {spec!r} is not a class, so it takes no init_args")
    return target


def clear_cache() -> None:
    """Forget what was discovered (tests that install plugins at run time use this)."""
    with _lock:
        _cache.clear()
        _loaded.clear()
        _conflicts.clear()


# ------------------------------------------------------------------------------------ typed plugin arguments
def group_of_base(cls: Any) -> str | None:
    """The plugin group whose arguments are typed with ``cls`` (one of :data:`PLUGIN_BASES`), else None."""
    path = f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}"
    return next((group for group, base in PLUGIN_BASES.items() if base == path), None)


def class_path_of(group: str, name: str) -> str | None:
    """The dotted import path of the plugin registered as ``name`` in ``group`` (None: not registered)."""
    info = discover(group).get(name)
    if info is None or not info.entry_point.attr:
        return None
    return f"{info.entry_point.module}.{info.entry_point.attr}"


def resolve_short_name(cls: Any, name: str, fallback: Any) -> str:
    """jsonargparse's class_path resolution for ``cls`` (a type or a tuple of types), registry short names first.

    ``fallback`` is jsonargparse's own resolver (subclass class names). A dotless name that neither resolves
    raises the registry's "unknown plugin" error for the group of ``cls``.
    """
    if ":" in name:  # the registry's import-path spelling, pkg.module:Class
        name = name.replace(":", ".")
    if "." in name:
        return fallback(cls, name)
    groups = [g for g in (group_of_base(c) for c in (cls if isinstance(cls, tuple) else (cls,))) if g]
    for group in groups:
        path = class_path_of(group, name)
        if path:
            return path
    resolved = fallback(cls, name)
    if groups and "." not in resolved:
        raise _unknown(groups[0], name)
    return resolved


def install_jsonargparse_resolver() -> None:
    """Make jsonargparse resolve registry short names in ``class_path`` (idempotent; see the module docstring)."""
    from jsonargparse import _typehints

    current = _typehints.resolve_class_path_by_name
    if getattr(current, "rlflow_registry", False):
        return
    original = current

    def resolve(cls: Any, name: str) -> str:
        return resolve_short_name(cls, name, original)

    resolve.rlflow_registry = True  # type: ignore[attr-defined]
    _typehints.resolve_class_path_by_name = resolve
    try:
        from jsonargparse import _from_config
    except ImportError:  # older jsonargparse: nothing else holds a reference
        return
    if getattr(_from_config, "resolve_class_path_by_name", None) is original:
        _from_config.resolve_class_path_by_name = resolve


def init_defaults(cls: type) -> tuple[dict[str, Any], bool]:
    """The keyword parameters of ``cls``'s constructor with their defaults, and whether it takes any keyword.

    A constructor with ``**kwargs`` is followed up the MRO (``GRPOLoss(delta, **kwargs)`` takes the options of
    ``RatioPolicyLoss`` too), as jsonargparse does; ``object.__init__`` ends the walk.
    """
    params: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            return params, False
        signature = inspect.signature(init)
        for p in list(signature.parameters.values())[1:]:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in params:
                params[p.name] = None if p.default is p.empty else p.default
        if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            return params, False
    return params, True


def apply_settings(cls: type, init_args: dict[str, Any], settings: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Put each of ``settings`` (None: not set) into ``init_args`` where the class takes it and it is unset.

    "Unset" means still the class's default (jsonargparse fills every default in, so an explicit value equal to
    the default cannot be told apart, and means the same). Returns the conflicts, ``{key: (init_args value,
    setting)}``, where ``init_args`` holds another explicit value; those are left as they are.
    """
    params, _ = init_defaults(cls)
    conflicts: dict[str, tuple[Any, Any]] = {}
    for key, value in settings.items():
        if value is None or key not in params:
            continue
        given = init_args.get(key, params[key])
        if given == params[key] or given == value:
            init_args[key] = value
        else:
            conflicts[key] = (given, value)
    return conflicts
