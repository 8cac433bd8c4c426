import sys

from rlflow.cli import main

sys.exit(main())
