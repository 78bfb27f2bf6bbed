import sys

from lanner.cli import main

sys.exit(main())
