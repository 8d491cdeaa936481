"""`python -m edgellm` is the `edgellm` command."""

import sys

from edgellm.cli import main

sys.exit(main())
