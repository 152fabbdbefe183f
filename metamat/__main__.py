"""python -m metamat: see metamat/cli.py."""
import sys

from .cli import main

sys.exit(main())
