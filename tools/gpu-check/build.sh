#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything tools/gpu-check/run.sh runs on one: the CUDA
# builds (release, `--features cuda`) of the llama tests, `generate` example and decode benchmark,
# the module-runtime and root integration tests (the torch.nn fixtures and the parity tests take
# their device from MODULE_DEVICE) and the train_digits example; strips them and packs them into
# .gpu/bin.tar.xz (about 12 MB: every binary holds the same PTX of candle's kernels, ~55 MB, which
# one 256 MiB xz dictionary stores once). `.gpu/` is in .gitignore; a device call carries
# `.gpu` and runs `bash tools/gpu-check/run.sh`.
#
# Needs the CUDA 13 toolkit that .ci/run assembles (~/.cache/candle-module/cuda13: run .ci/run once
# on a fresh machine). About 15 minutes on 2 cores from a cold target folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
toolkit="${XDG_CACHE_HOME:-$HOME/.cache}/candle-module/cuda13"
[ -f "$toolkit/.complete" ] || { echo "no CUDA toolkit at $toolkit: run .ci/run first" >&2; exit 1; }
export CUDA_HOME="$toolkit/nvidia/cu13" PATH="$toolkit/nvidia/cu13/bin:$PATH" CUDA_COMPUTE_CAP=90
export CUDAFORGE_THREADS=2 CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/cuda}"
out=$(mktemp -d)
# build PREFIX CARGO-ARGS...: copies each executable built to $out/PREFIX<target name>.
build() {
  local prefix=$1
  shift
  cargo build --release --features cuda --message-format=json-render-diagnostics "$@" |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        shutil.copy(m["executable"], sys.argv[1] + "/" + sys.argv[2] + m["target"]["name"])' "$out" "$prefix"
}
build llama- -p llama --features peers --example generate --bench decode --bench train_step --test llama
build minilm- -p minilm --bench autocast_step
build mr- -p module-runtime --test integration
build root- -p candle-module --example train_digits --test integration
strip "$out"/*
ls -la "$out"
mkdir -p .gpu
tar cf - -C "$out" . | xz -T2 --lzma2=preset=6,dict=256MiB >.gpu/bin.tar.xz
rm -rf "$out"
# The MiniLM step's config and tokenizer (run.sh saves random weights of that shape beside them).
minilm=${MINILM_DIR:-../shared/models/all-MiniLM-L6-v2}
mkdir -p .gpu/minilm
cp "$minilm"/{config.json,tokenizer.json,tokenizer_config.json,special_tokens_map.json,vocab.txt} .gpu/minilm/
ls -la .gpu/bin.tar.xz
