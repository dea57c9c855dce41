"""kvserve's HTTP server and engine: everything that owns the one loaded model."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvserve")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+src"
