"""Device code of fly-gemm (private): the kernels and their host launchers."""
