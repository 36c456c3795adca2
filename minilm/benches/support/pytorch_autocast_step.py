"""PyTorch's side of `cargo bench -p minilm --bench autocast_step`: the MiniLM fine-tuning step of
`train_step` (train mode, dropout on; loss = mean((mean-pooled embedding . v)^2),
v = arange(384) / 384 - 0.5; fused AdamW, lr 1e-5), its forward under
`torch.autocast("cpu", dtype=torch.bfloat16)` when the last argument is `autocast`, as PyTorch's
AMP recipe runs it (backward and step outside the scope); and one product `[200, 384] x
[384, 1536]` timed in float32 and under autocast.

    python pytorch_autocast_step.py MODEL_DIR SENTENCES_FILE REPS [autocast|plain]

MODULE_DEVICE (`cuda:0`) runs it on that GPU under `torch.autocast("cuda", ...)`, each timed part
ending with `torch.cuda.synchronize()`.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

# Two threads, as the Rust side, or what RAYON_NUM_THREADS gives it.
torch.set_num_threads(int(os.environ.get("RAYON_NUM_THREADS", "2")))
torch.manual_seed(0)
model_dir, sentences, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
amp = len(sys.argv) > 4 and sys.argv[4] == "autocast"
device = os.environ.get("MODULE_DEVICE") or "cpu"
kind = device.split(":")[0]


def sync():
    if kind == "cuda":
        torch.cuda.synchronize()


x = torch.randn(200, 384, device=device)
w = torch.randn(1536, 384, device=device, requires_grad=True)
b = torch.randn(1536, device=device, requires_grad=True)
for label, enabled in (("float32", False), ("autocast bf16", True)):
    times = []
    with torch.autocast(kind, dtype=torch.bfloat16, enabled=enabled):
        for i in range(30):
            t = time.perf_counter()
            y = F.linear(x, w, b)
            sync()
            if i >= 5:
                times.append(time.perf_counter() - t)
    times.sort()
    print(f"pytorch product {label}: {times[len(times) // 2] * 1e6:.0f} us ({y.dtype})",
          file=sys.stderr)

m = AutoModel.from_pretrained(model_dir).to(device).train()
tok = AutoTokenizer.from_pretrained(model_dir)
lines = open(sentences).read().splitlines()
enc = tok(lines, return_tensors="pt", padding=True).to(device)
v = torch.arange(384, dtype=torch.float32, device=device) / 384 - 0.5
opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
mask = enc["attention_mask"].float().unsqueeze(2)
steps, parts = [], []
for i in range(reps + 2):
    t = time.perf_counter()
    with torch.autocast(kind, dtype=torch.bfloat16, enabled=amp):
        h = m(**enc).last_hidden_state
        pooled = (h * mask).sum(1) / mask.sum(1)
        loss = ((pooled * v).sum(1) ** 2).mean()
    sync()
    t1 = time.perf_counter()
    opt.zero_grad()
    loss.backward()
    sync()
    t2 = time.perf_counter()
    opt.step()
    sync()
    if i >= 2:
        e = time.perf_counter()
        steps.append(e - t)
        parts.append((t1 - t, t2 - t1, e - t2))
steps.sort()
median = steps[len(steps) // 2]
f, bw, o = (sum(p[k] for p in parts) / len(parts) for k in range(3))
tag = "autocast bf16" if amp else "float32"
print(f"pytorch ({tag}) train step: batch {len(lines)} x {enc['input_ids'].shape[1]}: "
      f"median {median * 1e3:.1f} ms (min {steps[0] * 1e3:.1f}); mean forward {f * 1e3:.0f} ms, "
      f"backward {bw * 1e3:.0f} ms, AdamW {o * 1e3:.0f} ms; hidden {h.dtype}", file=sys.stderr)
