"""``python -m service.cli``: the ``foldwise`` command (:func:`service.cli.main`)."""

import sys

from service.cli import main

sys.exit(main())
