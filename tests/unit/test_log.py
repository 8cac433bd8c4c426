"""rlflow/log.py: rlflow's messages go to standard output as it is when they are logged."""

from __future__ import annotations

import contextlib
import io

from rlflow.log import info


def test_messages_follow_a_redirected_stdout():
    """A notebook's or a test's capture replaces ``sys.stdout`` after rlflow was imported: messages reach the
    replacement (a handler bound at import time would write to the old stream, or fail once it is closed)."""
    for _ in range(2):  # the second capture after the first one closed
        with contextlib.redirect_stdout(io.StringIO()) as out:
            info("hello from rlflow")
        assert out.getvalue() == "[rlflow] hello from rlflow\n"
        out.close()


def test_a_process_that_only_generates_reads_its_rank_from_the_environment_without_lightning():
    """The generator process logs through :mod:`rlflow.log` without importing Lightning (seconds of imports in
    every such process): its rank comes from the launcher's environment, as Lightning's import reads it, so rank 1
    of a two-rank run says nothing."""
    import os
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    script = (
        "import sys\n"
        "from rlflow.log import info\n"
        "import rlflow.rollout.engine, rlflow.rollout.worker, rlflow.rollout.select, rlflow.training.packing\n"
        "import torch\n"
        "from rlflow.rollout.hardware import inference_context\n"
        "with inference_context(torch.nn.Linear(2, 2)):\n"  # what every rollout enters (FSDP units looked up)
        "    pass\n"
        "info('from rank one')\n"
        "print('lightning' in sys.modules)\n")
    for rank, said in (("1", False), ("0", True)):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID")}
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "RANK": rank},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "False"  # Lightning not imported
        assert ("[rlflow] from rank one" in done.stdout) == said
