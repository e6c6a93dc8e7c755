"""``python -m sgl_nixl_plugin``: the same CLI as the ``sgl-nixl-plugin`` script."""

import sys

from sgl_nixl_plugin.cli.main import main

sys.exit(main())
