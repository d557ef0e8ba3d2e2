"""``python -m mxcomm <command>``: same as the ``mxcomm`` console command (see :mod:`mxcomm.cli`)."""
import sys

from .cli import main

sys.exit(main())
