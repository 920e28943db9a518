#!/usr/bin/env bash
# bench/llama_cuda_table.sh - the rows of bench/llama_cuda.sh's side-by-side table, from the
# outputs it keeps: llama-bench's markdown (-o md), bench_gpu_arch's table, llama_state's lines
# and bench_gpu_engine's table. A figure a side did not print is "-" and its ratio too.
#   llama_cuda_table.sh row SPEC LLAMA_BENCH.md STRATA_ARCH.md
#   llama_cuda_table.sh state LLAMA_STATE.txt STRATA_ENGINE.md
set -uo pipefail
case "${1:-}" in
row)
  spec=$2 lmd=$3 smd=$4
  # llama-bench: the last column of its pp / tg rows is "t/s ± sd"
  pp=$(awk -F'|' '$0 ~ /\| *pp[0-9]+ *\|/ {split($(NF-1), a, " "); print a[1]; exit}' "$lmd" 2>/dev/null)
  tg=$(awk -F'|' '$0 ~ /\| *tg[0-9]+ *\|/ {split($(NF-1), a, " "); print a[1]; exit}' "$lmd" 2>/dev/null)
  # bench_gpu_arch: | model | tensors | device memory | prefill | decode, direct | decode, graphs | ...
  sp=$(awk -F'|' '$0 ~ /tok\/s/ && $0 ~ / ms / {split($5, a, " "); print a[1]; exit}' "$smd" 2>/dev/null)
  sg=$(awk -F'|' '$0 ~ /tok\/s/ && $0 ~ / ms / {split($7, a, " "); print a[1]; exit}' "$smd" 2>/dev/null)
  awk -v spec="$spec" -v pp="${pp:-}" -v tg="${tg:-}" -v sp="${sp:-}" -v sg="${sg:-}" 'BEGIN {
    st = sg != "" && sg > 0 ? 1000.0 / sg : "";
    r1 = pp != "" && sp != "" && pp > 0 ? sprintf("%.2fx", sp / pp) : "-";
    r2 = tg != "" && st != "" && tg > 0 ? sprintf("%.2fx", st / tg) : "-";
    printf "| %s | %s | %s | %s | %s | %s | %s |\n", spec,
      pp != "" ? sprintf("%.0f tok/s", pp) : "-", sp != "" ? sprintf("%.0f tok/s", sp) : "-", r1,
      tg != "" ? sprintf("%.0f tok/s", tg) : "-",
      st != "" ? sprintf("%.0f tok/s (%s ms)", st, sg) : "-", r2 }'
  ;;
state)
  lst=$2 smd=$3
  # llama_state: "op bytes ms GB/s" lines; bench_gpu_engine: "| NAME | T ms | ..." rows
  ms() { awk -v op="$1" '$1 == op {print $3; exit}' "$lst" 2>/dev/null; }
  sms() { awk -F'|' -v pat="$1" 'index($2, pat) == 2 {split($3, a, " "); print a[1]; exit}' "$smd" 2>/dev/null; }
  echo "| operation | llama.cpp | Strata | ratio |"
  echo "|---|---|---|---|"
  while IFS='@' read -r name lop spat; do
    l=$(ms "$lop") s=$(sms "$spat")
    awk -v n="$name" -v l="${l:-}" -v s="${s:-}" 'BEGIN {
      r = l != "" && s != "" && s > 0 ? sprintf("%.2fx", l / s) : "-";
      printf "| %s | %s | %s | %s |\n", n, l != "" ? l " ms" : "-", s != "" ? s " ms" : "-", r }'
  done <<'ROWS'
state to RAM (llama_state_seq_get_data; Strata PARK, bf16)@get@PARK to RAM (bf16
state from RAM (set_data; RESTORE, bf16)@set@RESTORE from RAM (bf16
save to a file with fsync (save_file; SAVE session file)@save@SAVE session file
load from the file (load_file; LOAD session file)@load@LOAD session file
save durably (save_file with fsync; SAVE to the store)@save@SAVE to the store
load from disk (load_file; RESTORE from the store, streamed)@load@RESTORE from the store, streamed
ROWS
  ;;
*)
  echo "usage: llama_cuda_table.sh row SPEC LLAMA.md STRATA.md | state LLAMA_STATE.txt STRATA.md" >&2
  exit 2
  ;;
esac
