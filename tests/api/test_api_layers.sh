#!/bin/sh
# test_api_layers.sh - api/'s dependencies point down (issue 13, section 3): the conversation
# manager (st_conv.h, st_conv.c, st_memguard.c) knows no HTTP, JSON or server code; the request
# plumbing (st_call.c) names no handler; no handler names the router; ST_API_HAVE_ENGINE is gone.
# Usage: test_api_layers.sh API_DIR. Exit 0 when every rule holds, else 1, naming each breach.
dir=${1:?usage: test_api_layers.sh API_DIR}
fail=0
tmp=$(mktemp) || exit 1
trap 'rm -f "$tmp"' EXIT
breach() { echo "test_api_layers: $1" >&2; fail=1; }
# hits PREFIX: each line of standard input (grep -n output) is a breach
hits() { while IFS= read -r l; do breach "$1$l"; done; }

for f in st_conv.h st_conv.c st_memguard.c; do
  [ -f "$dir/$f" ] || { breach "$f is missing"; continue; }
  # includes of the layers above, libevent and jansson
  grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](st_api_int\.h|event2/|jansson\.h|st_http)' \
       "$dir/$f" > "$tmp"; hits "$f: includes a layer above: " < "$tmp"
  # server, plumbing or handler calls and types (st_api_config and the ST_API_ constants of
  # st_api.h are plain data the manager may read)
  grep -noE '\b(st_api_[a-z_]+|st_http_[a-z_]+|json_[a-z_]+|evbuffer_[a-z_]+)\b' "$dir/$f" |
    grep -v ':st_api_config$' > "$tmp"; hits "$f: uses code above it: " < "$tmp"
done
# the plumbing is below the handlers and the router
grep -noE '\b(st_api_h_[a-z_]+|st_openai_[a-z_]+|routes_table|route_table)\b' "$dir/st_call.c" > "$tmp"
hits "st_call.c: names a handler or the router: " < "$tmp"
# handlers are below the router
for f in "$dir"/st_route_*.c "$dir/st_openai.c"; do
  grep -noE '\b(routes_table|route_table|on_head|parsed_run|st_api_server_new)\b' "$f" > "$tmp"
  hits "$(basename "$f"): names the router: " < "$tmp"
done
grep -rn 'ST_API_HAVE_ENGINE' "$dir" > "$tmp"; hits "ST_API_HAVE_ENGINE is still used: " < "$tmp"
[ $fail -eq 0 ] && echo "test_api_layers: every rule holds"
exit $fail
