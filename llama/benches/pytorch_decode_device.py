# PyTorch's side of the decode benchmark (benches/decode.rs) on the device that MODULE_DEVICE names
# (cuda:0; the CPU with 2 threads when unset): the random Llama shaped like SmolLM-135M that
# ../shared/perf/pytorch_decode.py makes (same config, same seed, so the same weights), f32, batch 1,
# prefill of a 128-token prompt, then 64 greedy tokens with the KV cache, each timing taken with the
# device synchronized. Run: MODULE_DEVICE=cuda:0 python pytorch_decode_device.py [SAVE_DIR]
import os, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM

device = torch.device(os.environ.get("MODULE_DEVICE") or "cpu")
torch.set_num_threads(2); torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                  rope_theta=10000.0, tie_word_embeddings=True)
m = LlamaForCausalLM(cfg).eval()
if len(sys.argv) > 1: m.save_pretrained(sys.argv[1], safe_serialization=True)
m = m.to(device)
ids = torch.randint(0, 49152, (1, 128)).to(device)

def sync():
    if device.type == "cuda": torch.cuda.synchronize(device)

with torch.no_grad():
    m.generate(ids[:, :16], max_new_tokens=4, do_sample=False)
    sync(); t = time.perf_counter(); out = m(ids, use_cache=True); sync(); pre = time.perf_counter() - t
    t = time.perf_counter()
    g = m.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    sync(); total = time.perf_counter() - t
print(f"params {sum(p.numel() for p in m.parameters())/1e6:.0f}M on {device}; prefill 128 tokens {pre*1e3:.1f} ms ({128/pre:.0f} tokens/s); "
      f"generate 64 tokens {total*1e3:.0f} ms incl. prefill -> decode {64/(total-pre):.1f} tokens/s")
