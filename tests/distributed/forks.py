"""A child process forked to run one function: a rank or a save, sharing the parent's imports."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable


def fork(body: Callable[[], int | None]) -> int:
    """Fork a child that runs ``body`` and exits with its result (``None``: 0; on any exception, 1 after
    printing its traceback); returns the child's pid.

    The child leaves with ``os._exit``, after flushing stdout and stderr: no interpreter teardown in a
    fork of a process that imported torch (see ``stock_lightning.py``).
    """
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = body()
            code = 0 if result is None else result
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid
