#!/usr/bin/env bash
# `make run`: the main job, end to end, with what this build delivers.
# Session files: build an image, write it as a session file, inspect, convert (bf16 + zstd),
# verify, diff against the original, and convert back to v1. With the engine built, it also makes
# the demo model, runs a conversation, saves it, and continues it in a new process.
set -euo pipefail
build=${1:-build}
bin="$build/tools"
work=${STRATA_RUN_DIR:-data/run}
mkdir -p "$work"

say() { printf '\n== %s\n' "$*"; }

say "statectl synth: a synthetic 2,000-token conversation state, written as a session file"
"$bin/statectl" synth "$work/demo.stsf" --tokens 2000 --layers 8 --head-dim 64 --checkpoints 3
say "statectl inspect $work/demo.stsf"
"$bin/statectl" inspect "$work/demo.stsf"
say "statectl convert: running state to bf16, checkpoints compressed (format v2)"
"$bin/statectl" convert "$work/demo.stsf" "$work/demo-bf16.stsf" --codec bf16 --compress zstd:3
"$bin/statectl" verify "$work/demo-bf16.stsf"
say "statectl diff: what bf16 costs"
"$bin/statectl" diff "$work/demo.stsf" "$work/demo-bf16.stsf" || true
say "statectl convert back to v1 (bf16 widens to fp32 exactly)"
"$bin/statectl" convert "$work/demo-bf16.stsf" "$work/demo-v1.stsf" --codec fp32 --format v1
"$bin/statectl" verify "$work/demo-v1.stsf"
ls -l "$work"/*.stsf

if [ -x "$bin/strata" ] && [ -x "$bin/strata-mkmodel" ]; then
  model=models/small.gguf
  if [ ! -f "$model" ]; then
    say "strata-mkmodel: the small demo model (seeded weights: the text is not meaningful)"
    mkdir -p models
    "$bin/strata-mkmodel" --preset small -o "$model"
  fi
  say "strata generate: 24 tokens, then save the conversation"
  "$bin/strata" generate -m "$model" -p "Hello, Strata." -n 24 --temp 0 --session-out "$work/chat.stsf" | od -c | head -5
  say "strata generate --session-in: continue the saved conversation in a new process"
  "$bin/strata" generate -m "$model" --session-in "$work/chat.stsf" -p " And then?" -n 24 --temp 0 | od -c | head -5
  "$bin/statectl" inspect "$work/chat.stsf" | head -12
fi
