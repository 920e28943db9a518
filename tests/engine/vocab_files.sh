#!/bin/sh
# vocab_files.sh BUNDLE OUTDIR - extract llama.cpp's vocabulary tests (models/ggml-vocab-
# {qwen2,qwen35,llama-bpe}.gguf with .inp / .out) from the llama.cpp v0.4.0 source that
# node-llama-cpp ships as a git bundle (tests/ref, installed by `make deps`) into OUTDIR, once
# per bundle (a stamp of its size and time). Nothing is committed to the project.
set -eu
bundle=$1 out=$2
if [ ! -f "$bundle" ]; then
  echo "vocab_files: $bundle not found: tests/ref is not installed (run make deps)" >&2
  exit 1
fi
command -v git >/dev/null 2>&1 || { echo "vocab_files: git not found (make deps)" >&2; exit 1; }
stamp="$(stat -c '%s %Y' "$bundle")"
if [ "$(cat "$out/.stamp" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
rm -rf "$out" "$out.git"
mkdir -p "$out"
git clone -q --bare "$bundle" "$out.git"
for m in qwen2 qwen35 llama-bpe; do
  for ext in "" .inp .out; do
    git --git-dir="$out.git" show "HEAD:models/ggml-vocab-$m.gguf$ext" > "$out/ggml-vocab-$m.gguf$ext"
  done
done
rm -rf "$out.git"
echo "$stamp" > "$out/.stamp"
