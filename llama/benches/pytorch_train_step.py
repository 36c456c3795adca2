# PyTorch's side of the Llama training-step benchmark (train_step.rs beside this file): one process runs
# one variant on the SmolLM-135M-shaped checkpoint in MODEL_DIR (the decode benchmark's), f32, CPU,
# 2 threads, and prints the line `figures MEDIAN_NS CPU_NS LOAD_PEAK_MIB PEAK_MIB BEFORE_MIB LOSS`.
#
#   python pytorch_train_step.py MODEL_DIR VARIANT BATCH SEQ STEPS
#
# VARIANT `make` saves the SmolLM-135M-shaped random Llama (seed 0, the decode benchmark's model) into
# MODEL_DIR and exits (`python pytorch_train_step.py MODEL_DIR make 0 0 0`).
# VARIANT: `lora` (peft LoRA r=8, lora_alpha=16, no dropout, on q/k/v/o/gate/up/down_proj; AdamW lr 1e-3,
# weight decay 0.01 on the adapters only), `lora-ckpt` (the same after
# `gradient_checkpointing_enable(use_reentrant=False)`), `full` (AdamW lr 1e-5, weight decay 0.01 on every parameter),
# `full-ckpt` (the same after `gradient_checkpointing_enable(use_reentrant=False)`). The batch is the
# benchmark's fixed token ids (id = (7919 * i + 13) % vocab over the batch's positions i), the loss
# transformers' own (`labels=ids`: next-token cross-entropy over every position's logits). One warm-up
# step, then STEPS timed steps (forward, backward, optimizer step, zero_grad). Memory: after the model
# is loaded the process's peak resident set (VmHWM) is read (LOAD_PEAK) and reset to the current one
# (`/proc/self/clear_refs` 5); PEAK is VmHWM after the steps, BEFORE the resident set before them.
# MODULE_DEVICE (`cuda:0`): the model and the batch on that device, each step ending with
# `torch.cuda.synchronize()`.
import os, sys, time, resource
import torch
from transformers import LlamaForCausalLM

torch.set_num_threads(2)
torch.manual_seed(0)
model_dir, variant, batch, seq, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024.0
    return float("nan")


if variant == "make":
    # The checkpoint, when there is none: the decode benchmark's model (the same seeded random
    # Llama shaped like SmolLM-135M), saved into MODEL_DIR.
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
    sys.exit(0)
m = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
m.config.use_cache = False
if variant in ("lora", "lora-ckpt"):
    from peft import LoraConfig, get_peft_model
    if variant == "lora-ckpt":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    m = get_peft_model(m, cfg)
    params, lr = [p for p in m.parameters() if p.requires_grad], 1e-3
elif variant in ("full", "full-ckpt"):
    if variant == "full-ckpt":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params, lr = list(m.parameters()), 1e-5
else:
    sys.exit(f"unknown variant {variant}")
device = os.environ.get("MODULE_DEVICE") or "cpu"
m.to(device)
m.train()
opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
vocab = m.config.vocab_size
ids = ((torch.arange(batch * seq, dtype=torch.int64) * 7919 + 13) % vocab).reshape(batch, seq).to(device)

load_peak = status("VmHWM:")
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS:")


def step():
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device != "cpu":
        torch.cuda.synchronize()
    return loss.item()


first = step()
cpu0, times = resource.getrusage(resource.RUSAGE_SELF), []
for _ in range(steps):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / steps
peak = status("VmHWM:")
times.sort()
print(f"figures {int(times[len(times) // 2] * 1e9)} {int(cpu * 1e9)} {load_peak:.1f} {peak:.1f} {before:.1f} {first:.6f}")
