"""The ``llmd-supervisor`` command line."""
