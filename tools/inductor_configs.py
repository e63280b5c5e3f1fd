"""Which kernels and launch configs torch.compile (Inductor) picks for the fly-norm peers, and their speed.

Run on the GPU machine with TORCHINDUCTOR_CACHE_DIR pointing at an empty folder:
Inductor writes each generated kernel there (``*.py``) and, after autotuning,
its chosen config (``*.best_config``). This script times each compiled peer
(bf16, 2^27 elements) against the device copy and packs the kernels and
configs into ``<out>/inductor.tgz`` for reading (not for committing).

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python tools/inductor_configs.py $OUT
"""

import json
import os
import sys
import tarfile
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
dev, dt = "cuda", torch.bfloat16
widths = [int(v) for v in (sys.argv[2:] or [1024, 8192, 16384, 32768])]


def copy_gbs():
    a = torch.empty(1 << 28, device=dev, dtype=torch.uint8)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300)
    return 2 * a.numel() / ms / 1e6


ceiling = copy_gbs()
ops = {
    "rms_norm": (lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6), 1),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), 2),
    "softmax": (lambda x, w, b: torch.softmax(x, -1), 0),
}
rows = []
for name, (fn, nparams) in ops.items():
    for n in widths:
        m = (1 << 27) // n
        x = torch.randn(m, n, device=dev, dtype=dt)
        w = torch.randn(n, device=dev, dtype=dt)
        b = torch.randn(n, device=dev, dtype=dt)
        torch._dynamo.reset()
        cf = torch.compile(fn, dynamic=False)
        ms = do_bench(lambda cf=cf, x=x, w=w, b=b: cf(x, w, b), warmup=25, rep=200)
        fwd_bytes = 2 * (2 * m * n + nparams * n)
        rows.append({"op": name, "N": n, "pass": "fwd", "us": ms * 1e3, "pct": 100 * fwd_bytes / ms / 1e6 / ceiling})
        if n >= 8192:
            xg = x.clone().requires_grad_(True)
            wg = w.clone().requires_grad_(nparams > 0)
            bg = b.clone().requires_grad_(nparams > 1)
            dy = torch.randn_like(x)
            y = cf(xg, wg, bg)
            grad = lambda y=y, xg=xg, dy=dy: torch.autograd.grad(y, [xg], dy, retain_graph=True)  # noqa: E731
            ms = do_bench(grad, warmup=25, rep=200)
            rows.append({"op": name, "N": n, "pass": "bwd", "us": ms * 1e3,
                         "pct": 100 * 2 * 3 * m * n / ms / 1e6 / ceiling})
        print(json.dumps(rows[-1]), flush=True)

(out / "inductor.json").write_text(json.dumps({"copy_gbs": ceiling, "rows": rows}, indent=1))
cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "/tmp"))
with tarfile.open(out / "inductor.tgz", "w:gz") as tar:
    for p in cache.rglob("*"):
        kernel = p.suffix == ".py" and "triton" in p.read_text(errors="ignore")
        if p.is_file() and (p.suffix == ".best_config" or kernel):
            tar.add(p, arcname=str(p.relative_to(cache)))
