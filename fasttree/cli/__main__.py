"""``python -m fasttree.cli``: the same as the ``fasttree-tune`` script."""

import sys

from .main import main

sys.exit(main())
