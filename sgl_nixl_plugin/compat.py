"""The old name of :mod:`sgl_nixl_plugin.adapter.release_gate`, the same module object.

Kept only for ``cli/doctor.py``, which is being edited elsewhere; delete this file once it
imports ``adapter.release_gate``. Everything else uses the new name.
"""

import sys

from sgl_nixl_plugin.adapter import release_gate

sys.modules[__name__] = release_gate
