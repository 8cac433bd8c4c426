"""A pairwise covering design: a few runs, each turning on several options at once, such that every pair of
options that can work together is on together in at least one run.

Options are names. Some cannot be combined by construction (``exclusive`` groups: the values of one setting,
such as the rollout backends); some pairs are refused by rlflow (``refused``). Every other pair is *allowed*
and must be covered. :func:`covering_runs` builds the runs greedily and deterministically (the same inputs give
the same runs, in the same order): each run starts from the first uncovered pair and takes, one at a time, the
option that covers the most uncovered pairs with the options already in it (ties: the cheaper, then the earlier
in ``options``), as long as it covers at least one.

* Options with a ``cost`` above 1 are *expensive*: their pairs are covered first, by runs that start from them;
  a run started from one takes another only if that pair is not covered yet, and no later run takes them, so
  they are on in as few runs as the greedy finds.
* Options ``apart`` (those that need hardware some machines lack: a GPU) come last: the pairs of the other
  options are covered without them, so that a machine that skips every run with one of them still runs every
  other pair; then each ``apart`` option's own pairs are covered by runs started from it.
* Some options switch another off (``inert``: ``(option, switcher)``; the run goes on without ``option`` and says
  so). A run tests such a pair (that it trains, with the line saying so), but not ``option``'s pairs with the
  rest of the run: those count only in runs where ``option`` is really on (:func:`run_pairs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

Pair = frozenset[str]


def conflicts(a: str, b: str, exclusive: Iterable[Iterable[str]]) -> bool:
    """Whether ``a`` and ``b`` are two values of one setting (in one ``exclusive`` group)."""
    return any(a in group and b in group for group in exclusive)


def allowed_pairs(options: Sequence[str], exclusive: Iterable[Iterable[str]], refused: Iterable[Pair]) -> list[Pair]:
    """Every pair of ``options`` that is neither exclusive nor refused, in the order of ``options``."""
    exclusive, refused = [set(g) for g in exclusive], set(refused)
    return [frozenset(p) for p in itertools.combinations(options, 2)
            if not conflicts(*p, exclusive) and frozenset(p) not in refused]


def switched_off(run: Iterable[str], inert: Iterable[tuple[str, str]] = ()) -> set[str]:
    """The options of ``run`` that another option of it switches off."""
    run = set(run)
    return {option for option, switcher in inert if option in run and switcher in run}


def run_pairs(run: Iterable[str], inert: Iterable[tuple[str, str]] = ()) -> set[Pair]:
    """The pairs ``run`` tests: those of the options that are on, and each switched-off option with its switchers."""
    inert = list(inert)
    off, tested = switched_off(run, inert), {frozenset(p) for p in inert}
    pairs = (frozenset(p) for p in itertools.combinations(sorted(set(run)), 2))
    return {p for p in pairs if not p & off or p in tested}


def covered_pairs(runs: Iterable[Iterable[str]], inert: Iterable[tuple[str, str]] = ()) -> set[Pair]:
    """The pairs of options that at least one of ``runs`` tests (:func:`run_pairs`)."""
    inert = list(inert)
    return {p for run in runs for p in run_pairs(run, inert)}


def covering_runs(options: Sequence[str], exclusive: Iterable[Iterable[str]] = (), refused: Iterable[Pair] = (),
                  cost: Mapping[str, float] | None = None, apart: Sequence[str] = (),
                  inert: Iterable[tuple[str, str]] = ()) -> list[tuple[str, ...]]:
    """Runs (tuples of options, in the order of ``options``) that cover every allowed pair; see the module."""
    cost, inert = dict(cost or {}), list(inert)
    exclusive = [set(g) for g in exclusive]
    refused = set(refused)
    todo = allowed_pairs(options, exclusive, refused)
    uncovered = {p for p in todo if not p & set(apart)}
    main = [o for o in options if o not in apart]
    expensive = [o for o in main if cost.get(o, 1.0) > 1.0]
    runs: list[tuple[str, ...]] = []

    def compatible(option: str, run: list[str]) -> bool:
        return option not in run and all(
            not conflicts(option, m, exclusive) and frozenset((option, m)) not in refused for m in run)

    def gain(option: str, run: list[str]) -> int:
        """How many more uncovered pairs ``run`` tests with ``option``; none for an option that would switch off
        one of the run's (an uncovered pair the run tests would no longer be), and for an expensive option whose
        pair with the option the run started from is covered (it joins one of that option's runs, not each)."""
        if option in expensive and frozenset((option, run[0])) not in uncovered:
            return 0
        before, after = run_pairs(run, inert) & uncovered, run_pairs([*run, option], inert) & uncovered
        return len(after - before) if before <= after else 0

    def grow(run: list[str], candidates: list[str]) -> None:
        while True:
            gains = [(gain(o, run), -cost.get(o, 1.0), -i, o) for i, o in enumerate(candidates) if compatible(o, run)]
            best = max(gains, default=None)
            if best is None or best[0] == 0:
                return
            run.append(best[3])

    def add(run: list[str]) -> None:
        uncovered.difference_update(run_pairs(run, inert))
        runs.append(tuple(o for o in options if o in run))

    def start_from(option: str, candidates: list[str]) -> None:
        while any(option in p for p in uncovered):
            first = next(p for p in todo if option in p and p in uncovered)
            run = [option, *(o for o in options if o in first and o != option)]
            grow(run, candidates)
            add(run)

    for heavy in expensive:  # each expensive option's pairs, in runs started from it
        start_from(heavy, main)
    cheap = [o for o in main if o not in expensive]
    while uncovered:
        first = next(p for p in todo if p in uncovered)
        run = [o for o in options if o in first]
        grow(run, cheap)
        add(run)
    uncovered.update(p for p in todo if p & set(apart))
    for option in apart:
        start_from(option, list(options))
    return runs
