"""`python -m lanner` = the `lanner` command."""
import sys

from lanner.cli import main

sys.exit(main())
