"""``python -m boost_compiler.cli``: the ``boost`` command."""

import sys

from . import main

sys.exit(main())
