"""Private device code of the fly-norm ops: Triton kernels and the device helpers they share (not public API).
The host code that plans and launches them is in the package modules (:mod:`fly_norm._norm_host`,
:mod:`fly_norm._split_host`, :mod:`fly_norm._row_plans`, :mod:`fly_norm.softmax`).
"""
