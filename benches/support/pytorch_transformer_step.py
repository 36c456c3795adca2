"""PyTorch's side of `cargo bench --bench transformer_step`: `nn.TransformerEncoder` of 2
`nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024, dropout=0.1, batch_first=True)`, train
mode, a `[16, 64, 256]` batch, loss = mean of the output's squares, fused AdamW (lr 1e-4). Prints
the median step time in milliseconds after 2 warm-up steps.

    python pytorch_transformer_step.py STEPS
"""

import os
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("RAYON_NUM_THREADS", "2")))
torch.manual_seed(0)
steps = int(sys.argv[1])
layer = torch.nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024, dropout=0.1, batch_first=True)
encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
opt = torch.optim.AdamW(encoder.parameters(), lr=1e-4, fused=True)
x = torch.randn(16, 64, 256)
times = []
for i in range(steps + 2):
    t = time.perf_counter()
    loss = encoder(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i >= 2:
        times.append(time.perf_counter() - t)
times.sort()
print(f"{times[len(times) // 2] * 1e3:.3f}")
