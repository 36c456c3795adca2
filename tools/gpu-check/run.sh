#!/usr/bin/env bash
# Runs on the lent GPU machine (x86-64, NVIDIA driver, python3 with torch, transformers and CUDA's
# libraries; no Rust) what tools/gpu-check/build.sh packed into .gpu/bin.tar.xz, with
# MODULE_DEVICE=cuda:0: the llama tests (logits and greedy tokens against transformers', cache,
# batches, quantized weights), the torch.nn fixtures, the root parity tests, the `generate` example
# against transformers' greedy tokens, a train_digits run, and the decode benchmark interleaved with
# PyTorch on the same GPU (benches/pytorch_decode_device.py). Logs go to $OUT when set. Each part
# has its own time limit; the whole stays under 9 minutes.
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
step() { echo; echo "=== $* ($(date +%T))"; }
tests() { # NAME LIMIT BINARY ARGS...
  local name=$1 limit=$2
  shift 2
  step "$name"
  timeout "$limit" "$@" --test-threads 8 >"$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "test result|panicked|FAILED|^failures" "$OUT/$name.log" | head -40
}
tests llama-tests 100 $B/llama-llama
tests torch-nn-fixtures 80 $B/mr-integration nn_
tests root-integration 120 $B/root-integration
step "generate example, tiny-llama fixture, greedy"
python3 - <<'PY'
import json, subprocess
d = "llama/tests/fixtures/tiny-llama"
ref = json.load(open(d + "/reference.json"))
lines = "".join(json.dumps(p) + "\n" for p in ref["prompts"])
n = len(ref["generated"][0])
r = subprocess.run([".gpu/bin/llama-generate", "--model", d, "--max-new-tokens", str(n), "--device", "cuda:0"],
                   input=lines, capture_output=True, text=True, timeout=60)
print(r.stderr[-2000:])
got = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
print(f"generate: {len(got)} prompts, equal to transformers' greedy tokens: {got == ref['generated']}")
PY
step "train_digits"
timeout 60 $B/root-train_digits --device cuda:0 2>&1 | tail -12
step "decode benchmark"
PYTORCH=python3 PYTORCH_DECODE=llama/benches/pytorch_decode_device.py LLAMA_BENCH_DIR=/tmp/smollm \
  QUANTIZE=q8_0,q4_0 timeout 180 $B/llama-decode 5 2>&1 | tee "$OUT/decode.log" | grep -v "^round"
step "done"
