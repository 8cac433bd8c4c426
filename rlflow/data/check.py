"""``rlflow data check``: validate every row of every data source before a run, without training.

``rlflow data check --config c.yaml`` reads the same config as ``rlflow fit`` (``--data.*`` overrides work);
``rlflow data check SOURCE... [--tokenizer T] [--judgers JSON] ...`` checks data paths directly (files, globs,
folders, ``dir?split=train``, ``hf://OWNER/NAME?config=C&split=S`` from the local cache). Every row is read
(streaming: memory stays flat), parsed, routed to its judgers (each judger's ``required_columns`` must be
present), rendered with the chat template or prompt template, and tokenized; each judger is also called once
on a few rows of every source with an empty completion, to catch a judger that cannot read that source's
columns. The report gives counts, prompt-length percentiles, dropped rows with the reason, the mix's
per-step shares, and the first errors with ``file:line``. Rows with images (``images``/``image``) have every
image resolved, opened and decoded, and are tokenized with the model's processor, image tokens included. The exit
code is 1 when a row is malformed, a row has no usable judger, a judger fails, or a source has no usable prompt;
over-long prompts only warn (training drops them too). Simplification: judgers are probed on a few rows per
source, not run on every row.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow.data.dataset import DataError, PromptRecord
from rlflow.data.images import has_images
from rlflow.data.prompts import prompt_key, shared_items
from rlflow.data.sources import DataSource, iter_records
from rlflow.judgers.panel import column_hint
from rlflow.models.vision import image_prompt_length
from rlflow.registry import PluginError

MAX_SHOWN = 10
PROBE_ROWS = 4
TOKENIZE_CHUNK = 256


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class SourceReport:
    """What the check found in one source: counts, kept prompt lengths, dropped rows and errors."""

    split: str
    name: str
    path: str
    weight: float
    limit: int
    routes: str = ""
    rows: int = 0
    malformed: int = 0
    unjudgeable: int = 0
    too_long: int = 0
    lengths: list[int] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    #: (prompt_key, row) of each kept prompt without images: eval prompts are matched to train prompts by them
    prompts: list[tuple[int, str]] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)  # an eval source's rows whose prompt is also a train prompt

    @property
    def kept(self) -> int:
        return len(self.lengths)

    def error(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_SHOWN:
            self.errors.append(message)

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.kept > 0


@dataclass
class CheckReport:
    """The check of every source of a run; ``ok`` when training would start without a data error."""

    sources: list[SourceReport]
    batch_size: int  # prompts per step of the configured mix; 0 when the sources are not a mix
    tokenized: bool

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.sources) and not self.too_few

    @property
    def too_few(self) -> bool:
        """Fewer usable train prompts than one rollout step takes (``fit`` refuses that)."""
        kept = sum(s.kept for s in self.sources if s.split == "train")
        return self.batch_size > 0 and kept < self.batch_size


def probe_judgers(report: SourceReport, runner: Any, probes: dict[str, list[PromptRecord]]) -> None:
    """Call each judger once on a few of this source's rows with an empty completion; record any failure."""
    for name, records in probes.items():
        completions = [[{"role": "assistant", "content": ""}] if isinstance(r.prompt, list) else "" for r in records]
        keys = sorted({key for r in records for key in r.columns})
        kwargs = {
            "prompts": [r.prompt for r in records], "completions": completions, "completion_ids": [[] for _ in records],
            **{key: [r.columns.get(key) for r in records] for key in keys},
        }
        try:  # through the runner, as in training: its threads, event loops and data.judging.timeout
            out, exc = runner.call_all({name: kwargs})[name]
            if exc is not None:
                raise exc
            if out is not None and len(list(out)) != len(records):
                raise ValueError(f"returned {len(list(out))} rewards for {len(records)} completions")
        except Exception as exc:
            report.error(
                f"{records[0].source}: judger {name!r} fails on rows of {report.name}: {type(exc).__name__}: {exc}"
            )


def judgeable(report: SourceReport, runner: Any, where: str, item: PromptRecord) -> list[str] | None:
    """The judgers ``item`` is routed to, or None (counted and reported) when none can judge it: no route for its
    ``data_source``, or a column a judger requires is missing."""
    try:
        names = runner.route(item.data_source)
    except KeyError as exc:
        report.unjudgeable += 1
        report.error(f"{where}: {exc.args[0] if exc.args else exc}")
        return None
    missing = [
        f"judger {name!r} needs column {col!r}" for name in names
        for col in getattr(runner.judgers[name], "required_columns", ()) if item.columns.get(col) is None
    ]
    if missing:
        report.unjudgeable += 1
        report.error(f"{where}: {'; '.join(missing)}, which the row lacks{column_hint(missing)}")
        return None
    return names


def check_source(dm: Any, source: DataSource, split: str, tokenizer: Any) -> SourceReport:
    """Read, route, render and tokenize every row of ``source`` the way ``dm`` would for training."""
    prompts = dm.train_prompts if split == "train" else dm.eval_prompts
    limit = source.max_prompt_length or prompts.max_prompt_length
    report = SourceReport(split, source.name or "", source.path, source.weight, limit)
    runner = dm.judges.routing.runners.get(source.name, dm.judges.default)
    report.routes = ", ".join(f"{key} -> {'+'.join(names)}" for key, names in runner.routes.items())
    fmt = prompts.format_for(source)
    probes: dict[str, list[PromptRecord]] = {}
    pending: list[tuple[str, str]] = []

    def add_length(where: str, length: int) -> None:
        if length > limit:
            report.too_long += 1
            if len(report.dropped) < MAX_SHOWN:
                report.dropped.append(f"{where}: {length} prompt tokens > max_prompt_length {limit}")
        else:
            report.lengths.append(length)

    def flush() -> None:
        if not pending:
            return
        ids = tokenizer([text for _, text in pending], add_special_tokens=False)["input_ids"]
        for (where, text), row_ids in zip(pending, ids):
            add_length(where, len(row_ids))
            if len(row_ids) <= limit:
                report.prompts.append((prompt_key(text), where))
        pending.clear()

    try:
        for where, item in iter_records(source.path, key=source.key):
            report.rows += 1
            if isinstance(item, DataError):
                report.malformed += 1
                report.error(str(item))
                continue
            names = judgeable(report, runner, where, item)
            if names is None:
                continue
            for name in names:
                if len(probes.setdefault(name, [])) < PROBE_ROWS:
                    probes[name].append(item)
            if has_images(item):  # every image read and decoded; image tokens counted (rlflow.models.vision)
                try:
                    length = image_prompt_length(item, fmt, getattr(dm, "processor", None), tokenizer is not None)
                except DataError as exc:
                    report.malformed += 1
                    report.error(str(exc))
                    continue
                if tokenizer is not None:
                    add_length(where, length)
                else:
                    report.lengths.append(0)
                continue
            if tokenizer is None:
                report.lengths.append(0)
                continue
            try:
                pending.append((where, fmt.render(item, tokenizer)))
            except DataError as exc:
                report.malformed += 1
                report.error(str(exc))
                continue
            if len(pending) >= TOKENIZE_CHUNK:
                flush()
        flush()
    except DataError as exc:  # the source as a whole cannot be read
        report.error(str(exc))
        return report
    probe_judgers(report, runner, probes)
    if report.rows == 0:
        report.error(f"{source.path}: the dataset is empty (no rows)")
    return report


def check_datamodule(dm: Any, tokenize: bool = True, mix: bool = True) -> CheckReport:
    """Check every train and eval source of a :class:`RolloutDataModule` (``tokenize=False`` skips lengths;
    ``mix=False`` leaves out the per-step shares, for files that are not a configured mix)."""
    tokenizer = dm.load_tokenizer() if tokenize else None
    reports = [check_source(dm, s, "train", tokenizer) for s in dm.train_prompts.sources]
    reports += [check_source(dm, s, "eval", tokenizer) for s in dm.eval_prompts.sources]
    trained = {key for r in reports if r.split == "train" for key, _ in r.prompts}
    for report in reports:
        if report.split == "eval":
            report.shared = shared_items(trained, report.prompts)
    return CheckReport(reports, dm.global_batch_size if mix else 0, tokenize)


def format_report(report: CheckReport) -> str:
    """The human-readable report ``rlflow data check`` prints."""
    lines = []
    train = [s for s in report.sources if s.split == "train"]
    total_weight = sum(s.weight for s in train) or 1.0
    for s in report.sources:
        lines.append(f"{s.split} source {s.name!r}: {s.path}")
        lines.append(
            f"  rows {s.rows} | malformed {s.malformed} | no judger/column {s.unjudgeable} | "
            f"too long {s.too_long} | kept {s.kept}"
        )
        if report.tokenized and s.lengths:
            p = {q: percentile(s.lengths, q) for q in (50, 90, 99)}
            lines.append(
                f"  prompt tokens: p50 {p[50]:.0f}  p90 {p[90]:.0f}  p99 {p[99]:.0f}  max {max(s.lengths)}  "
                f"(max_prompt_length {s.limit})"
            )
        lines.append(f"  judgers: {s.routes}")
        if s.split == "train" and len(train) > 1 and report.batch_size:
            share = report.batch_size * s.weight / total_weight
            passes = f", one pass every {s.kept / share:.1f} steps" if s.kept else ""
            lines.append(f"  mix: weight {s.weight:g} -> {share:.2f} of {report.batch_size} prompts per step{passes}")
        if s.shared:
            lines.append(f"  {len(s.shared)} of its {s.kept} prompts are also train prompts (the first: "
                         f"{s.shared[0]}): eval/accuracy is not held-out accuracy on them")
        if s.too_long:
            lines.append(f"  dropped {s.too_long} row(s) longer than {s.limit} tokens (training drops them too):")
            lines += [f"    {d}" for d in s.dropped]
        if s.error_count:
            lines.append(f"  {s.error_count} error(s); the first {len(s.errors)}:")
            lines += [f"    {e}" for e in s.errors]
        elif s.kept == 0:
            lines.append("  no usable prompt in this source")
    if not report.tokenized:
        lines.append("(no tokenizer: prompt lengths not measured; pass --tokenizer or use --config)")
    kept = {split: sum(s.kept for s in report.sources if s.split == split) for split in ("train", "eval")}
    if report.too_few:
        lines.append(f"{kept['train']} usable train prompts, fewer than data.global_batch_size={report.batch_size} "
                     "(one rollout step's prompts): rlflow fit refuses to start")
    verdict = "OK" if report.ok else "FAILED"
    errors = sum(s.error_count for s in report.sources)
    lines.append(
        f"{verdict}: {len(report.sources)} source(s), {kept['train']} usable train and {kept['eval']} eval prompts, "
        f"{sum(s.too_long for s in report.sources)} dropped as too long, {errors} error(s)"
    )
    return "\n".join(lines)


USAGE = """usage: rlflow data check --config c.yaml [--config more.yaml] [--data.KEY=VALUE ...]
       rlflow data check SOURCE [SOURCE ...] [--tokenizer PATH] [--max-prompt-length N] [--judgers JSON]
                         [--system-prompt S] [--prompt-template T] [--chat-template-kwargs JSON]"""


def datamodule_from_config(args: list[str]) -> Any:
    """The ``RolloutDataModule`` an ``rlflow fit`` with these arguments would build.

    The config is parsed exactly as ``rlflow fit`` parses it (links, overrides, several ``--config``), but no
    ``Trainer`` is built, so a config for 8 GPUs can be checked on a CPU-only login node; nothing is trained.
    """
    import logging
    import warnings

    from rlflow.cli import RLFlowCLI, cli_main

    class DataOnlyCLI(RLFlowCLI):
        def instantiate_trainer(self, **kwargs: Any) -> None:
            return None

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return cli_main(args, run=False, cli_class=DataOnlyCLI).datamodule


def datamodule_from_files(argv: list[str]) -> tuple[Any, bool]:
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.data.settings import JudgingSettings, PromptSettings

    ap = argparse.ArgumentParser(prog="rlflow data check", usage=USAGE)
    ap.add_argument("files", nargs="+", help="data files, globs, directories or hf://OWNER/NAME?config=C&split=S hub "
                    "datasets in the local cache; each is one source")
    ap.add_argument("--tokenizer", help="tokenizer (model) directory; without it prompt lengths are not measured")
    ap.add_argument("--max-prompt-length", type=int, default=512)
    ap.add_argument(
        "--judgers", type=json.loads, default=None, help='routing as JSON, e.g. \'{"openai/gsm8k": "gsm8k"}\''
    )
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--prompt-template", default=None)
    ap.add_argument(
        "--chat-template-kwargs", type=json.loads, default=None, help='JSON, e.g. \'{"enable_thinking": false}\''
    )
    a = ap.parse_args(argv)
    files = a.files[0] if len(a.files) == 1 else a.files  # one file as a config gives it: errors name it as fit's do
    dm = RolloutDataModule(
        train_data_path=files, tokenizer_path=a.tokenizer, max_prompt_length=a.max_prompt_length,
        judging=JudgingSettings(judgers=a.judgers),
        prompts=PromptSettings(system_prompt=a.system_prompt, template=a.prompt_template,
                               chat_template_kwargs=a.chat_template_kwargs),
    )
    return dm, a.tokenizer is not None


def main(argv: list[str] | None = None) -> int:
    """``rlflow data ...``: dispatch ``check``; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "check" or argv[1:2] in (["-h"], ["--help"]):
        print(USAGE + "\n\n" + __doc__.split("\n\n")[1])
        return 0 if argv[1:2] in (["-h"], ["--help"]) else 2
    args = argv[1:]
    try:
        if any(a == "--config" or a.startswith(("--config=", "--data.", "--model.")) for a in args):
            dm, tokenize, mix = datamodule_from_config(args), True, True
        else:
            (dm, tokenize), mix = datamodule_from_files(args), False
        report = check_datamodule(dm, tokenize=tokenize, mix=mix)
    except (ValueError, FileNotFoundError, DataError, PluginError, TypeError) as exc:  # as rlflow fit says them
        print(f"rlflow: error: {exc}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0 if report.ok else 1
