"""fly-conv: FlyDSL convolution kernels.

Implicit-GEMM convolution 1D / 2D / 3D (forward and backward), a direct depthwise kernel, bias and
activation fused; ``nn.Module`` drop-ins. ``__all__`` is the public contract.
"""

from ._version import __version__
from .autotune import ConvConfig
from .conv import conv, conv1d, conv2d, conv3d
from .modules import FlyConv1d, FlyConv2d, FlyConv3d
from .reference import conv_ref

__all__ = ["__version__", "conv", "conv1d", "conv2d", "conv3d", "FlyConv1d", "FlyConv2d", "FlyConv3d", "ConvConfig",
           "conv_ref"]  # fmt: skip
