"""The backend kit: the 1-D fragments every backend yields when it saves and fills when it loads,
the sharded-optimizer helpers, and the checks a load runs on live objects before it writes them
(:mod:`.validate`). Plugins reach it through :mod:`accelkit.sdk`."""
