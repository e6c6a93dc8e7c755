"""Test configuration. Keep this file thin: reusable code lives in ``tests/helpers/``.

To add fixtures or hooks, put them in a module under ``tests/helpers/`` and import them
here (pytest only sees names defined in, or imported into, this module).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # makes ``helpers`` importable

from helpers.fixtures import *  # noqa: E402,F403
