"""accelkit-deepspeed: DeepSpeed ZeRO 0-3 (with offload, bf16 and fp16) as accelkit backends.

Importing this package imports nothing of DeepSpeed; the backends import it when first built.
"""

from __future__ import annotations

__version__ = "0.1.0"
