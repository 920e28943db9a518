#!/bin/sh
# test_make_run.sh ROOT BUILD TMP - `make run`'s steps (tools/run.sh as the Makefile calls it, with
# STRATA_PORT=0 and STRATA_READY_FILE) in the scratch directory TMP: the demo model is built
# (qwen35 with the Qwen3 vocabulary of tests/ref and its chat template: <|im_start|> is one token,
# the template renders ChatML turns), the server starts on it and answers /healthz with its engine,
# the curl and OpenAI-client examples are printed, SIGTERM stops it with status 0; MODEL=FILE
# serves that file; MODEL naming no file is refused with a message.
set -eu
root=$1 build=$2 tmp=$3
rm -rf "$tmp"
mkdir -p "$tmp"
cd "$tmp"
fail() { echo "test_make_run: $*" >&2; cat log >&2 2>/dev/null || true; exit 1; }

# start MODEL: run.sh in the background; the ready file is the event (bounded at 120 s: an ASan
# build on a loaded machine builds the 170 MB demo model and loads it in tens of seconds)
start() {
  rm -f ready
  STRATA_PORT=0 STRATA_READY_FILE="$tmp/ready" MODEL="$1" bash "$root/tools/run.sh" "$build" \
    > log 2>&1 &
  pid=$!
  i=0
  while [ ! -s ready ]; do
    kill -0 "$pid" 2>/dev/null || fail "the server exited before listening"
    i=$((i + 1))
    if [ "$i" -gt 6000 ]; then
      kill -9 "$pid"
      fail "the server did not listen within 120 s"
    fi
    sleep 0.02
  done
  port=$(cat ready)
}

stop() {
  kill -TERM "$pid"
  rc=0
  wait "$pid" || rc=$?
  [ "$rc" -eq 0 ] || fail "the server exited with $rc after SIGTERM"
}

start ""
grep -q "strata-mkmodel: wrote models/demo-qwen35.gguf: qwen35-small" log || fail "no demo model built"
curl -sf "http://127.0.0.1:$port/healthz" | grep -q '"engine":true' || fail "/healthz: no engine"
grep -q "/v1/chat/completions" log || fail "no curl example"
grep -q "from openai import OpenAI" log || fail "no OpenAI-client example"
stop
info=$("$build/tools/strata" info -m models/demo-qwen35.gguf)
echo "$info" | grep -q "architecture qwen35" || fail "demo model: $info"
echo "$info" | grep -q "vocab 151669" || fail "demo model: not the Qwen3 vocabulary: $info"
[ "$("$build/tools/strata" tokenize -m models/demo-qwen35.gguf --parse-special '<|im_start|>user')" = "151644 872" ] ||
  fail "demo model: <|im_start|>user is not 151644 872"
printf '%s' '{"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true}' > c.json
[ "$("$build/tools/strata" chat-template -m models/demo-qwen35.gguf --conversation c.json 2>&1)" = \
  "$(printf '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')" ] ||
  fail "demo model: not Qwen3's chat template"

# the model is kept: a second start builds nothing
start ""
grep -q "strata-mkmodel" log && fail "the demo model was built again"
stop

# MODEL=FILE: that file is served
"$build/tools/strata-mkmodel" --preset tiny -o h.gguf > /dev/null 2>&1
start "$tmp/h.gguf"
grep -q "model $tmp/h.gguf" log || fail "MODEL=h.gguf not served"
curl -sf "http://127.0.0.1:$port/healthz" | grep -q '"engine":true' || fail "/healthz: no engine"
stop

# MODEL naming no file: refused, saying so
rc=0
MODEL=nowhere.gguf bash "$root/tools/run.sh" "$build" > log 2>&1 || rc=$?
[ "$rc" -eq 1 ] && grep -q "MODEL=nowhere.gguf: no such file" log || fail "a missing MODEL not refused"
echo "test_make_run: demo model built and served, MODEL=FILE served, a missing MODEL refused"
rm -rf "$tmp"
