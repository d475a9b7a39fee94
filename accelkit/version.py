"""accelkit's version, in a module of its own: core modules that record it (the checkpoint
manifest, the plugin report) read it here instead of importing the package's public face."""

__version__ = "0.1.0"
