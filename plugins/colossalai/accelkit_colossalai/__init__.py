"""accelkit-colossalai: ColossalAI's Booster plugins behind accelkit's backend protocol.

Nothing here imports colossalai; the backends import it when they are built.
"""

__version__ = "0.1.0"
