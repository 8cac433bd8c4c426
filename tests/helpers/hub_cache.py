"""Hub datasets laid out in a ``datasets`` cache as ``load_dataset("owner/name", config)`` leaves them, built from
rows in the test: no download, no hub account."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_hub_dataset(cache: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> Path:
    """Prepare ``splits`` (split name -> rows) as configuration ``config`` of hub dataset ``repo`` in the ``datasets``
    cache ``cache``: ``<owner>___<name>/<config>/0.0.0/<commit>/`` with its ``dataset_info.json`` and one Arrow file
    per split, written by ``datasets``' own JSON builder. Returns that folder."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    owner, name = repo.split("/")
    work = cache / ".build" / repo / config
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    builder = Json(cache_dir=str(work / "out"), dataset_name=camelcase_to_snakecase(name), config_name=config,
                   config_id=config, hash=COMMIT, data_files=files)
    builder.download_and_prepare()
    built = work / "out" / camelcase_to_snakecase(name) / config / "0.0.0" / COMMIT
    target = cache / f"{owner}___{camelcase_to_snakecase(name)}" / config / "0.0.0" / COMMIT
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(built), str(target))
    return target
