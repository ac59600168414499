"""divtrace's version, defined here once (the package metadata reads it too)."""

__version__ = "0.1.0"
