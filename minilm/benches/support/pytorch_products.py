"""PyTorch's side of `cargo bench -p minilm --bench products`: the same `x @ w.T` products
(`torch.nn.functional.linear` without a bias), 2 threads, the median of `reps` calls after 20
warm-up calls, one line per shape: `name m k n median_ms`.

    python pytorch_products.py REPS NAME:M:K:N [NAME:M:K:N ...]
"""
import sys
import time

import torch

torch.set_num_threads(2)
reps = int(sys.argv[1])
for spec in sys.argv[2:]:
    name, m, k, n = spec.split(":")
    m, k, n = int(m), int(k), int(n)
    x = torch.randn(m, k)
    w = torch.randn(n, k)
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{name} {m} {k} {n} {times[len(times) // 2] * 1e3:.4f}")
