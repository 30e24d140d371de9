"""``python -m qkv ...``: the same as the ``qkv`` command."""
import sys

from .cli import main

sys.exit(main())
