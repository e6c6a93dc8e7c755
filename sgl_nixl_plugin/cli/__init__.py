"""Command-line interface: ``sgl-nixl-plugin {version,doctor,bench}``."""
