"""What every ``foldwise`` command shares about failing: the exit code for bad input and the
error that carries it. Its own module, so that service/cli/__init__.py and service/cli/service.py both
import it and neither imports the other for it."""

from __future__ import annotations

EXIT_INVALID = 2  # bad input (the message on stderr names the field), or a database that cannot be used as is


class UsageError(Exception):
    """Bad input from the command line (exit 2)."""
