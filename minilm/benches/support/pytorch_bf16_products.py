"""PyTorch's side of `cargo bench -p minilm --bench bf16_products`: the same `x @ w.T` products
(`torch.nn.functional.linear` without a bias) on float32 and on bfloat16 tensors, 2 threads,
interleaved call by call, the median of `reps` calls of each after 20 warm-up calls, one line per
shape: `name m k n f32_median_ms bf16_median_ms`.

    python pytorch_bf16_products.py REPS NAME:M:K:N [NAME:M:K:N ...]
"""
import os
import sys
import time

import torch

# Two threads, as the Rust side, or what RAYON_NUM_THREADS gives it.
torch.set_num_threads(int(os.environ.get("RAYON_NUM_THREADS", "2")))
reps = int(sys.argv[1])
for spec in sys.argv[2:]:
    name, m, k, n = spec.split(":")
    m, k, n = int(m), int(k), int(n)
    x = torch.randn(m, k)
    w = torch.randn(n, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    with torch.no_grad():
        for _ in range(20):
            torch.nn.functional.linear(x, w)
            torch.nn.functional.linear(xb, wb)
        t32, t16 = [], []
        for _ in range(reps):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            t32.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.nn.functional.linear(xb, wb)
            t16.append(time.perf_counter() - start)
    t32.sort()
    t16.sort()
    med = lambda t: t[len(t) // 2] * 1e3
    print(f"{name} {m} {k} {n} {med(t32):.4f} {med(t16):.4f}")
