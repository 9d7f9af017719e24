"""The package version, in a leaf so that any layer can read it without importing ``ember``."""

__version__ = "0.1.0"
