"""Tools returning hostile values, for the tool-result tests: a huge string, a list that contains itself, an object
whose ``__str__`` raises. Standard library only, so a worker process loads them in milliseconds."""

from __future__ import annotations


def huge(n: int) -> str:
    """Returns ``n`` characters.

    Args:
        n: How many.
    """
    return "x" * n


def circular(x: int) -> list:
    """Returns a list that contains itself (``json.dumps`` raises ValueError).

    Args:
        x: Its first element.
    """
    a: list = [x]
    a.append(a)
    return a


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text\nfor you")


def unprintable(x: int) -> Unprintable:
    """Returns an object whose ``__str__`` raises.

    Args:
        x: Ignored.
    """
    return Unprintable()


def echo(x: int) -> int:
    """Returns ``x``.

    Args:
        x: The value.
    """
    return x
