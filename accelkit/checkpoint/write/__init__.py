"""Saving: the plan of each rank's file, the rank agreement that closes every step
(:mod:`.agreement`), the asynchronous save's snapshot and writer process, and the commit."""
