"""Adapters that put accelkit under other training frameworks.

Each adapter is a subpackage that imports its framework when imported itself, so that
``import accelkit`` never does: ``import accelkit.integrations.mmengine`` needs
``pip install accelkit[mmengine]``.
"""
