#!/usr/bin/env bash
# Runs on the lent GPU machine (x86-64, NVIDIA driver, python3 with torch, transformers and CUDA's
# libraries; no Rust) what tools/gpu-check/build.sh packed into .gpu/bin.tar.xz, with
# MODULE_DEVICE=cuda:0: the llama tests (logits and greedy tokens against transformers', cache,
# batches, quantized weights), the torch.nn fixtures, the root parity tests, the `generate` example
# against transformers' greedy tokens, a train_digits run, and the decode benchmark interleaved with
# PyTorch on the same GPU (benches/pytorch_decode_device.py); then the training-step benchmarks
# against PyTorch on the same GPU: MiniLM's float32 and bfloat16-autocast step (on a random
# all-MiniLM-L6-v2-shaped model that python3 saves from the config and tokenizer build.sh packs into
# .gpu/minilm: the real weights are over the 64 MiB a call carries; the speed is the shapes'), and
# the SmolLM-135M-shaped Llama's LoRA and full fine-tuning steps. Logs go to $OUT when set. Each
# part has its own time limit, cut to what is left of 8.5 minutes for the whole.
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# The binaries find their fixtures by the paths they were compiled at (CARGO_MANIFEST_DIR).
built_at=${BUILT_AT:-/work/main}
if [ "$(realpath "$built_at" 2>/dev/null)" != "$PWD" ]; then
  mkdir -p "$(dirname "$built_at")" && ln -sfn "$PWD" "$built_at"
fi
nv=$(python3 -c "import nvidia, os; print(nvidia.__path__[0])")
LD_LIBRARY_PATH=$(find "$nv" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:):${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH MODULE_DEVICE=cuda:0
B=.gpu/bin
mkdir -p $B && tar xJf .gpu/bin.tar.xz -C $B || exit 1
nvidia-smi -L
ldd $B/llama-generate | grep -E "not found|libcu"
deadline=$((SECONDS + 510))
step() { echo; echo "=== $* ($(date +%T))"; }
# limit SECONDS: SECONDS, or what is left before the deadline if less (at least 1).
limit() { local left=$((deadline - SECONDS)); [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"; }
tests() { # NAME LIMIT BINARY ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name"
  timeout "$(limit "$limit")" "$@" --test-threads 8 >"$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "test result|panicked|FAILED|^failures" "$OUT/$name.log" | head -40
}
tests llama-tests 60 $B/llama-llama
tests root-integration 75 $B/root-integration
tests torch-nn-fixtures 45 $B/mr-integration nn_
step "generate example, tiny-llama fixture, greedy"
python3 - <<'PY'
import json, subprocess
d = "llama/tests/fixtures/tiny-llama"
ref = json.load(open(d + "/reference.json"))
lines = "".join(json.dumps(p) + "\n" for p in ref["prompts"])
n = len(ref["generated"][0])
r = subprocess.run([".gpu/bin/llama-generate", "--model", d, "--max-new-tokens", str(n), "--device", "cuda:0"],
                   input=lines, capture_output=True, text=True, timeout=45)
print(r.stderr[-2000:])
got = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
print(f"generate: {len(got)} prompts, equal to transformers' greedy tokens: {got == ref['generated']}")
PY
step "train_digits"
timeout "$(limit 40)" $B/root-train_digits --device cuda:0 2>&1 | tail -12
step "MiniLM training step, float32 and bf16 autocast, against PyTorch"
python3 -c "
from transformers import BertConfig, BertModel
import torch; torch.manual_seed(0)
BertModel(BertConfig.from_pretrained('.gpu/minilm')).save_pretrained('.gpu/minilm')"
MINILM_DIR=.gpu/minilm PYTORCH=python3 timeout "$(limit 90)" $B/minilm-autocast_step 3 2>&1 |
  tee "$OUT/autocast_step.log"
step "Llama training steps (LoRA, full) against PyTorch + peft"
PYTORCH=python3 LLAMA_BENCH_DIR=/tmp/smollm TRAIN_STEP_VARIANTS=lora,full,lora-ckpt,full-ckpt \
  timeout "$(limit 150)" $B/llama-train_step 1 3 2>&1 | tee "$OUT/train_step.log"
step "decode benchmark"
PYTORCH=python3 PYTORCH_DECODE=llama/benches/pytorch_decode_device.py LLAMA_BENCH_DIR=/tmp/smollm \
  QUANTIZE=q8_0,q4_0 timeout "$(limit 120)" $B/llama-decode 2 2>&1 | tee "$OUT/decode.log" | grep -v "^round"
step "done"
