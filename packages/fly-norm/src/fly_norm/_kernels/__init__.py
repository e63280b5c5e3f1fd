"""Private device kernels and host plumbing shared by the fly-norm ops (not public API)."""
