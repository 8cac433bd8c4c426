"""Write docs/configuration.md and docs/errors.md from rlflow's code (``--check``: exit 1 if they are stale).

The generator is :mod:`rlflow.config_reference`; run this from a checkout: ``python tools/gen_config_reference.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlflow.config_reference import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
