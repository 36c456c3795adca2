#!/usr/bin/env bash
# Seeds each fuzz target's corpus (fuzz/corpus/<target>, not committed) with the repository's own
# fixtures of its format: small safetensors files, the .pth checkpoints in both containers, the
# GGUF files, the optimizer checkpoints. Run from anywhere; files already there are kept.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
corpus="$root/fuzz/corpus"
mkdir -p "$corpus"/{safetensors,pth,gguf,optim_state,peft}
# The 12 smallest safetensors fixtures (about 1 KB each).
find "$root/fixtures/pytorch" -maxdepth 1 -name '*.safetensors' -size -3k | sort | head -12 |
  xargs -I{} cp -n {} "$corpus/safetensors/"
p="$root/fixtures/pytorch/checkpoints"
cp -n "$p/gapnet_zip.pth" "$p/gapnet_legacy.pth" "$p/gapnet_nested.pt" \
  "$p/gapnet_sharded_bin/pytorch_model-00001-of-00002.bin" "$corpus/pth/"
cp -n "$root"/llama/tests/fixtures/*.gguf "$corpus/gguf/"
cp -n "$root"/fixtures/pytorch/optim/*.pt "$root"/fixtures/pytorch/scheduler/*.pt "$corpus/optim_state/"
find "$root/fixtures/pytorch/optim" -name '*.safetensors' -size -8k | head -4 |
  xargs -I{} cp -n {} "$corpus/optim_state/"
# PEFT adapter folders as the `peft` target reads an input: the config's length (2 bytes,
# little-endian), the config, the weights.
for config in $(find "$root/fixtures/peft" -name adapter_config.json | sort); do
  folder="$(dirname "$config")"
  seed="$corpus/peft/$(basename "$(dirname "$folder")")-$(basename "$folder")"
  [ -e "$seed" ] && continue
  len=$(wc -c <"$config")
  { printf "\\x$(printf %02x $((len & 255)))\\x$(printf %02x $((len >> 8)))"
    cat "$config" "$folder/adapter_model.safetensors"; } >"$seed"
done
