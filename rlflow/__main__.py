import sys

from rlflow.entry import main

sys.exit(main())
