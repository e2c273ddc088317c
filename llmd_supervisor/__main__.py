"""`python -m llmd_supervisor` is the `llmd-supervisor` command."""

import sys

from llmd_supervisor.cli.main import main

sys.exit(main())
