import sys

from rlflow.entry import script

sys.exit(script())
