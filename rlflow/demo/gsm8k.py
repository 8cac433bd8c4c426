"""Convert GSM8K as the Hugging Face hub lays it out into rlflow's (XTuner's / verl's) RL jsonl format.

``huggingface-cli download openai/gsm8k --repo-type dataset --local-dir gsm8k_data`` gives
``gsm8k_data/main/{train,test}-00000-of-00001.parquet`` (and ``socratic/`` beside it), each row a ``question`` and
an ``answer`` whose last line is ``#### <number>``. This script writes ``train.jsonl`` and ``test.jsonl`` with
one row per problem, exactly as verl's ``examples/data_preprocess/gsm8k.py`` and XTuner's GSM8K guide do:

* ``prompt``: one user message, the question plus ``Let's think step by step and output the final answer after
  "####".``;
* ``data_source: openai/gsm8k``, ``ability: math``;
* ``reward_model: {ground_truth, style: rule}``, the ground truth being the number after ``####`` with commas
  removed;
* ``extra_info: {answer, index, question, split}`` (``index`` is the row's position in its split).

The bytes match the published example rows: compact separators, ASCII-only escapes and ``/`` written ``\\/``
(PHP-style, as the examples were produced). jsonl input (the original ``grade-school-math`` repository's
``train.jsonl``/``test.jsonl``, or the same under ``main/``) is read too. Simplification: only the fields above
are written; nothing is filtered, deduplicated or re-split.

:func:`convert` does it; ``tools/convert_gsm8k.py`` is its command line::

    python tools/convert_gsm8k.py --input-dir ./gsm8k_data --out-dir ./gsm8k
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
DATA_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")
NUMBER = re.compile(r"-?[0-9][0-9.,]*")


class ConvertError(ValueError):
    """An input file is missing or a row cannot be converted; the message names the file and row."""


def ground_truth(answer: str, where: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, commas removed (verl's ``extract_solution``)."""
    if "####" not in answer:
        raise ConvertError(f"{where}: field 'answer' has no '#### <number>' final line")
    final = answer.rsplit("####", 1)[1].strip()
    if not NUMBER.fullmatch(final):
        raise ConvertError(f"{where}: field 'answer' ends with '#### {final}', which is not a number")
    return final.replace(",", "")


def convert_row(question: Any, answer: Any, index: int, split: str, where: str) -> dict[str, Any]:
    """One GSM8K problem as an RL row, fields in the order of the published examples."""
    for name, value in (("question", question), ("answer", answer)):
        if not isinstance(value, str) or not value.strip():
            raise ConvertError(f"{where}: field '{name}' must be a non-empty string, got {value!r}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"content": f"{question} {INSTRUCTION}", "role": "user"}],
        "ability": "math",
        "reward_model": {"ground_truth": ground_truth(answer, where), "style": "rule"},
        "extra_info": {"answer": answer, "index": index, "question": question, "split": split},
    }


def dumps(row: dict[str, Any]) -> str:
    """JSON exactly as the published example rows: compact, ASCII-escaped, ``/`` escaped as ``\\/``."""
    # "/" occurs in JSON output only inside strings, where "\/" is a valid escape of it.
    return json.dumps(row, ensure_ascii=True, separators=(",", ":")).replace("/", "\\/")


def find_inputs(input_dir: Path, split: str, subset: str) -> list[Path]:
    """The files of one split: hub parquet shards first, then jsonl, under ``<subset>/`` or the directory itself."""
    for folder in (input_dir / subset, input_dir):
        shards = sorted(folder.glob(f"{split}-*.parquet"))
        if shards:
            return shards
        for name in (f"{split}.jsonl", f"{split}.json"):
            if (folder / name).is_file():
                return [folder / name]
    return []


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(file:row, row)`` for every row of a parquet or jsonl file of raw GSM8K."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path, columns=["question", "answer"])
        except Exception as exc:  # missing column or not a parquet file: name the file
            raise ConvertError(f"{path}: cannot read question/answer columns: {type(exc).__name__}: {exc}") from exc
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"{path}:row {i}", row
        return
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConvertError(f"{path}:{lineno}: not a JSON object: {exc}") from exc
            if not isinstance(row, dict):
                raise ConvertError(f"{path}:{lineno}: the row must be a JSON object with 'question' and 'answer'")
            yield f"{path}:{lineno}", row


def convert_split(files: list[Path], split: str) -> list[str]:
    """Every row of ``files`` (in order) converted to a jsonl line."""
    lines = []
    for path in files:
        for where, row in read_rows(path):
            lines.append(dumps(convert_row(row.get("question"), row.get("answer"), len(lines), split, where)))
    return lines


def convert(
    input_dir: str | Path, out_dir: str | Path, subset: str = "main", splits: tuple[str, ...] = SPLITS
) -> dict[str, int]:
    """Convert each split found under ``input_dir`` into ``out_dir/<split>.jsonl``; return rows written per split."""
    input_dir, out_dir = Path(input_dir), Path(out_dir)
    if not input_dir.is_dir():
        raise ConvertError(f"--input-dir {input_dir} is not a directory")
    found = {split: find_inputs(input_dir, split, subset) for split in splits}
    missing = [split for split, files in found.items() if not files]
    if missing:
        present = sorted(str(p.relative_to(input_dir)) for p in input_dir.rglob("*") if p.is_file())[:20]
        raise ConvertError(
            f"no {'/'.join(missing)} data under {input_dir}: expected {subset}/<split>-*.parquet (the hub layout) or "
            f"<split>.jsonl; files there: {', '.join(present) or 'none'}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, files in found.items():
        lines = convert_split(files, split)
        if not lines:
            raise ConvertError(f"{', '.join(map(str, files))}: no rows")
        (out_dir / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="ascii")
        written[split] = len(lines)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--input-dir", required=True,
                    help="the hub download (e.g. ./gsm8k_data) or a folder of train/test jsonl")
    ap.add_argument("--out-dir", required=True, help="where train.jsonl and test.jsonl are written")
    ap.add_argument("--subset", default="main", help="the hub configuration folder: main (default) or socratic")
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), help="splits to convert (default: train test)")
    args = ap.parse_args(argv)
    try:
        written = convert(args.input_dir, args.out_dir, args.subset, tuple(args.splits))
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for split, n in written.items():
        print(f"wrote {n} rows to {Path(args.out_dir) / f'{split}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
