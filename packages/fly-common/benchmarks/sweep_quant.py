"""Sweep the quantization kernel's launch configurations on a GPU (chooses the default ladder).

    python packages/fly-common/benchmarks/sweep_quant.py

Prints GB/s (model bytes: read x, write q and the scales) per configuration
for per-token int8 at bf16 [M, N] with M * N = 128M, next to the device-copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import torch

import flydsl.arch
from flydsl.autotune.timer import bench
from flydsl_common.bench import copy_gbps
from flydsl_common.quant import QuantConfig, default_quant_config, quantize_per_token


def main() -> None:
    ceiling = copy_gbps(2 << 30)
    print(f"device {flydsl.arch.current().device_name}  copy {ceiling:.0f} GB/s")
    for n in (16384, 32768, 65536, 262144):
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        nbytes = m * n * 3 + 4 * m
        cfgs = {default_quant_config(n, 2)}
        for bm in (1,):
            for bn in (8192, 16384, 32768, 65536):
                for w in (8, 16, 32):
                    single = bn >= n
                    if single and bn > 2 * n:
                        continue
                    if bm * bn > 65536 or (not single and bm > 1) or (bm * bn) // (32 * w) > 256:
                        continue
                    cfgs.add(QuantConfig(bm, bn, w, single))
        rows = []
        for cfg in sorted(cfgs, key=lambda c: (c.block_m, c.block_n, c.num_warps)):
            try:
                t = bench(lambda cfg=cfg, x=x: quantize_per_token(x, torch.int8, config=cfg)).median_us
            except Exception as exc:  # out of resources etc.
                print(f"  {cfg}: failed {type(exc).__name__}")
                continue
            rows.append((nbytes / t / 1e3, cfg, t))
        rows.sort(key=lambda r: -r[0])
        d = default_quant_config(n, 2)
        dflt = next(r for r in rows if r[1] == d)
        print(f"N={n:6d} M={m:6d}  default {dflt[0]:6.0f} GB/s ({dflt[0] / ceiling:5.1%}) {d}")
        for gbps, cfg, t in rows[:4]:
            print(f"    {gbps:6.0f} GB/s ({gbps / ceiling:5.1%}) {t:8.1f} us  {cfg}")
        del x


if __name__ == "__main__":
    main()
