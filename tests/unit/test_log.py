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
