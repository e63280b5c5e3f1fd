"""Device code of fly-comm: the one-shot and two-shot all-reduce kernels (:mod:`.allreduce`)."""
