"""The generated pages (``docs/configuration.md``, ``docs/errors.md``) match the code, and the generator reads
what the code says: dataclass-typed parameters as groups of keys, plain ones as keys, every user-error raise."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def generator():
    from rlflow import config_reference

    return config_reference


def test_checked_in_pages_are_not_stale():
    done = subprocess.run([sys.executable, "tools/gen_config_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    gen = generator()
    page = tmp_path / "configuration.md"
    page.write_text("# an old page\n")
    monkeypatch.setattr(gen, "pages", lambda: {page: "# what the code says\n"})
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and page.read_text() == "# what the code says\n"
    assert gen.main(["--check"]) == 0


@dataclasses.dataclass
class Inner:
    """``x.opts.inner``: a nested group."""

    depth: int = 2
    """How deep."""


@dataclasses.dataclass
class Opts:
    """``x.opts``: some options."""

    rate: float = 0.5
    """A rate | with a pipe."""
    names: list[str] = dataclasses.field(default_factory=lambda: ["a"])
    """Names."""
    inner: Inner | None = None
    """Nested settings."""


class Thing:
    def __init__(self, path: str, size: int = 3, opts: Opts | None = None, flag: bool = True) -> None:
        """
        Args:
            path: Where it is.
            size: How big (``size`` > 0, see :class:`~rlflow.Thing`).
            opts: The options group.
            flag: A switch.
        """


def test_a_signature_becomes_keys_and_groups():
    gen = generator()
    group = gen.signature_group("x", Thing)
    assert [(k.name, k.type, k.default) for k in group.keys] == [
        ("x.path", "str", None), ("x.size", "int", "3"), ("x.flag", "bool", "true")]
    assert group.keys[1].doc == "How big (`size` > 0, see `rlflow.Thing`)."
    (opts,) = group.groups
    assert opts.prefix == "x.opts" and opts.doc == "The options group."
    assert [(k.name, k.default, k.doc) for k in opts.keys] == [
        ("x.opts.rate", "0.5", "A rate \\| with a pipe."), ("x.opts.names", '["a"]', "Names.")]
    (inner,) = opts.groups
    assert inner.prefix == "x.opts.inner" and [k.name for k in inner.keys] == ["x.opts.inner.depth"]
    text = "\n".join(gen.render_group(group, 2))
    assert "| `x.path` | `str` | required | Where it is. |" in text
    assert "### `x.opts`" in text and "#### `x.opts.inner`" in text


def test_every_key_of_the_module_and_the_datamodule_is_documented():
    gen = generator()
    for prefix, spec in gen.SECTIONS:
        group = gen.signature_group(prefix, gen.load(spec))
        stack, missing = [group], []
        while stack:
            g = stack.pop()
            missing += [k.name for k in g.keys if not k.doc]
            stack += g.groups
        assert not missing, f"keys without a docstring: {missing}"


def test_message_templates():
    gen = generator()
    expr = ast.parse('f"{key} must be >= {low}, got {value!r} ({len(x)} rows)"', mode="eval").body
    assert gen.template(expr) == "<key> must be >= <low>, got <value> (<...> rows)"
    assert gen.template(ast.parse('"a " + f"{b.c}"', mode="eval").body) == "a <b.c>"


def test_every_user_error_raise_is_in_the_index():
    gen = generator()
    raises = 0
    names = "|".join(sorted(gen.user_error_names()))
    for path in (ROOT / "rlflow").rglob("*.py"):
        raises += len(re.findall(rf"\braise ({names})\(", path.read_text()))
    messages = gen.error_messages()
    assert raises > 50 and len(messages) >= raises
    assert any("must be >= <low>, got <value>" in m.text for m in messages)


def test_every_error_family_has_a_troubleshooting_section():
    gen = generator()
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
               for h in re.findall(r"^## (.+)$", text, re.M)}
    assert set(gen.ERROR_FAMILIES.values()) <= anchors
