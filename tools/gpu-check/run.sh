#!/usr/bin/env bash
# Runs on the lent GPU machine (x86-64, NVIDIA driver, python3 with torch, transformers, peft and
# CUDA's libraries; no Rust) what tools/gpu-check/build.sh packed into .gpu/bin.tar.xz, with
# MODULE_DEVICE=cuda:0, in parts (`PARTS="tests llama"`; all by default, in this order):
#
# - tests: the root parity tests and the torch.nn fixtures (one process each);
# - llama: the llama tests, each in a process of its own (a device-side assertion poisons the
#   process's CUDA context, so one failing test must not take the others with it);
# - generate: the `generate` example against transformers' greedy tokens; train_digits: a run;
# - minilm_gpu: MiniLM's float32 and bfloat16-autocast training step against PyTorch on the GPU,
#   on a random all-MiniLM-L6-v2-shaped model that python3 saves from the config and tokenizer
#   build.sh packs into .gpu/minilm (the real weights are over the 64 MiB a call carries; the
#   speed is the shapes');
# - minilm_cpu: the same step on this machine's CPU (an Intel Xeon), both sides on the same 2
#   cores (taskset) and 2 threads;
# - train_step: the SmolLM-135M-shaped Llama's LoRA and full fine-tuning steps, with and without
#   gradient checkpointing, against PyTorch + peft on the GPU;
# - decode: the decode benchmark interleaved with PyTorch on the same GPU
#   (benches/pytorch_decode_device.py).
#
# Logs go to $OUT when set (at most 8 files come back from a device call: one per part). Each part
# has its own time limit, cut to what is left of 8.5 minutes for the whole.
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

part_tests() {
  tests root-integration 60 $B/root-integration
  tests torch-nn-fixtures 30 $B/mr-integration nn_
}

# One process per test, four at a time; a line per test that did not pass, with its message.
part_llama() {
  step "llama tests, one process each"
  local list
  list=$($B/llama-llama --list 2>/dev/null | sed -n 's/: test$//p')
  echo "$(echo "$list" | wc -l) tests"
  export B
  echo "$list" | timeout "$(limit 120)" xargs -P 4 -I{} bash -c '
    out=$(timeout 40 $B/llama-llama --exact "{}" --test-threads 1 2>&1); rc=$?
    if [ $rc -ne 0 ]; then
      printf "\n##### %s: exit %s\n%s\n" "{}" "$rc" "$(echo "$out" | grep -v "^\s*[0-9]*: <unknown>" | grep -v "^   at " | tail -25)"
    fi' >"$OUT/llama-each.log" 2>&1
  echo "exit $?; failing: $(grep -c '^#####' "$OUT/llama-each.log")"
  grep -E "^#####|panicked|Error|Assertion" "$OUT/llama-each.log" | cut -c1-400 | head -60
}

part_generate() {
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
}

part_train_digits() {
  step "train_digits"
  timeout "$(limit 40)" $B/root-train_digits --device cuda:0 2>&1 | tail -12
}

# A random all-MiniLM-L6-v2-shaped checkpoint beside the packed config and tokenizer (with the
# `position_ids` buffer the published checkpoint holds and transformers no longer saves).
minilm_model() {
  [ -f .gpu/minilm/model.safetensors ] && return
  python3 -c "
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel
torch.manual_seed(0)
m = BertModel(BertConfig.from_pretrained('.gpu/minilm'))
sd = {k: v.contiguous() for k, v in m.state_dict().items()}
sd['embeddings.position_ids'] = torch.arange(m.config.max_position_embeddings).unsqueeze(0)
save_file(sd, '.gpu/minilm/model.safetensors')"
}

part_minilm_gpu() {
  step "MiniLM training step on the GPU, float32 and bf16 autocast, against PyTorch"
  minilm_model
  MINILM_DIR=.gpu/minilm PYTORCH=python3 timeout "$(limit 60)" $B/minilm-autocast_step 3 2>&1 |
    tee "$OUT/minilm_gpu.log" | grep -v "product"
}

part_minilm_cpu() {
  step "MiniLM training step on this machine's CPU (2 cores, 2 threads), against PyTorch"
  minilm_model
  grep -m1 "model name" /proc/cpuinfo
  # Two cores that are not hyperthreads of one another: cpu 2 and the first outside its siblings.
  local second
  second=$(python3 -c "
s = open('/sys/devices/system/cpu/cpu2/topology/thread_siblings_list').read().strip()
ids = set()
for part in s.split(','):
    a, _, b = part.partition('-')
    ids.update(range(int(a), int(b or a) + 1))
print(next(c for c in range(3, 256) if c not in ids), '(siblings of cpu 2:', s + ')')" 2>/dev/null || echo 3)
  echo "cpus 2 and $second"
  second=${second%% *}
  MODULE_DEVICE= MINILM_DIR=.gpu/minilm PYTORCH=python3 RAYON_NUM_THREADS=2 \
    timeout "$(limit 120)" taskset -c "2,$second" $B/minilm-autocast_step 3 2>&1 | tee "$OUT/minilm_cpu.log"
}

part_train_step() {
  step "Llama training steps (LoRA, full; with and without checkpointing) against PyTorch + peft"
  PYTORCH=python3 LLAMA_BENCH_DIR=/tmp/smollm TRAIN_STEP_VARIANTS=${TRAIN_STEP_VARIANTS:-lora,lora-ckpt,full,full-ckpt} \
    timeout "$(limit 150)" $B/llama-train_step 1 3 2>&1 | tee "$OUT/train_step.log"
}

part_decode() {
  step "decode benchmark"
  PYTORCH=python3 PYTORCH_DECODE=llama/benches/pytorch_decode_device.py LLAMA_BENCH_DIR=/tmp/smollm \
    QUANTIZE=q8_0,q4_0 timeout "$(limit 120)" $B/llama-decode 2 2>&1 | tee "$OUT/decode.log" | grep -v "^round"
}

for part in ${PARTS:-tests llama generate train_digits minilm_gpu minilm_cpu train_step decode}; do
  "part_$part"
done
step "done"
