import sys

from leantune.cli import main

sys.exit(main())
