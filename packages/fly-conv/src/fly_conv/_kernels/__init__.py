"""Device code of fly-conv: one kernel kind a file."""
