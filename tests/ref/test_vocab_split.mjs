// test_vocab_split.mjs TOOLS_DIR TMP_DIR - the three pre-tokenizers (qwen2, qwen35, llama-bpe)
// against llama.cpp v0.4.0 (node-llama-cpp, vocabulary only) on 1 MiB of varied text
// (vocab_text.mjs), through a vocabulary made so that the ids show every word boundary: besides
// the 256 byte tokens it merges the bytes of each character of the text and then every pair of
// characters adjacent in it, so two characters become one token exactly when the splitter kept
// them in one word. (Real vocabularies hide much of it: Qwen2's merges never cross a combining
// mark, so llama.cpp's own qwen35 test file gives the same ids with qwen2's splitter.) Identical
// ids for each pre-tokenizer; the negative control (strata with qwen2's splitter against
// llama.cpp with qwen35's, and qwen2's against llama-bpe's) must differ.
import { execFileSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import path from "node:path";
import { getLlama } from "node-llama-cpp";
import { llamaTokenizeDefault } from "./llama_tokenize.mjs";
import { makeText } from "./vocab_text.mjs";

const [toolsDir, tmpDir] = process.argv.slice(2);
if (!toolsDir || !tmpDir) {
  console.error("usage: test_vocab_split.mjs TOOLS_DIR TMP_DIR");
  process.exit(2);
}
mkdirSync(tmpDir, { recursive: true });

// GPT-2's byte alphabet
const byteChar = [];
for (let b = 0, n = 0; b < 256; b++) {
  const self = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
  byteChar.push(String.fromCodePoint(self ? b : 256 + n++));
}
const enc = new TextEncoder();
const bl = (s) => Array.from(enc.encode(s), (b) => byteChar[b]).join("");

const text = makeText(1 << 20, [], 99);
const tokens = [...byteChar], merges = [], have = new Set(tokens);
const addMerge = (l, r) => {
  const t = l + r;
  if (have.has(t)) return;
  have.add(t);
  tokens.push(t);
  merges.push(`${l} ${r}`);
};
const chars = Array.from(text);
for (const c of new Set(chars)) { // each character's bytes, left to right
  const b = Array.from(enc.encode(c), (x) => byteChar[x]);
  let acc = b[0];
  for (let i = 1; i < b.length; i++) { addMerge(acc, b[i]); acc += b[i]; }
}
for (let i = 0; i + 1 < chars.length; i++) addMerge(bl(chars[i]), bl(chars[i + 1]));

function gguf(pre, arch) {
  const parts = [];
  const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); parts.push(b); };
  const u64 = (v) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); parts.push(b); };
  const str = (s) => { const b = Buffer.from(s, "utf8"); u64(b.length); parts.push(b); };
  const kvStr = (k, v) => { str(k); u32(8); str(v); };
  const kvStrArr = (k, a) => { str(k); u32(9); u32(8); u64(a.length); for (const s of a) str(s); };
  parts.push(Buffer.from("GGUF"));
  u32(3); u64(0); u64(5);
  kvStr("general.architecture", arch);
  kvStr("tokenizer.ggml.model", "gpt2");
  kvStr("tokenizer.ggml.pre", pre);
  kvStrArr("tokenizer.ggml.tokens", tokens);
  kvStrArr("tokenizer.ggml.merges", merges);
  return Buffer.concat(parts);
}

const file = path.join(tmpDir, "text.txt");
writeFileSync(file, text);
const llama = await getLlama({ gpu: false, build: "never", logLevel: "fatal" });
const ids = {};
let failed = 0;
const same = (a, b) => a.length === b.length && a.every((x, i) => x === b[i]);
for (const [pre, arch] of [["qwen2", "qwen3"], ["qwen35", "qwen35"], ["llama-bpe", "llama"]]) {
  const g = path.join(tmpDir, `split-${pre}.gguf`);
  writeFileSync(g, gguf(pre, arch));
  const out = execFileSync(path.join(toolsDir, "strata"), ["tokenize", "-m", g, "--file", file],
                           { encoding: "utf8", maxBuffer: 1 << 28 }).trim();
  const mine = out.split(" ").map(Number);
  const model = await llama.loadModel({ modelPath: g, vocabOnly: true });
  // llama-tokenize's default: BOS first where the vocabulary adds it (llama-bpe: by default), here
  // llama.cpp's default id of a gpt2 vocabulary without tokenizer.ggml.bos_token_id, 11
  const theirs = llamaTokenizeDefault(model, text, false, 11);
  const raw = Array.from(model.tokenize(text, false));
  await model.dispose();
  ids[pre] = { mine, theirs, raw };
  if (same(mine, theirs)) {
    console.log(`${pre}: ${theirs.length} ids (${tokens.length} tokens, ${merges.length} merges): strata = llama.cpp`);
  } else {
    failed++;
    let d = 0;
    while (d < mine.length && mine[d] === theirs[d]) d++;
    console.error(`${pre}: strata and llama.cpp differ at id ${d}: strata ${JSON.stringify(mine.slice(d, d + 6))}` +
      ` (${JSON.stringify(mine.slice(d, d + 6).map((i) => tokens[i]))}) llama.cpp ${JSON.stringify(theirs.slice(d, d + 6))}` +
      ` (${JSON.stringify(theirs.slice(d, d + 6).map((i) => tokens[i]))})`);
  }
}
for (const [a, b] of [["qwen2", "qwen35"], ["qwen2", "llama-bpe"]]) {
  // the splits alone (no BOS on either side), so the control is about the pre-tokenizer
  if (same(ids[a].mine, ids[b].raw)) {
    failed++;
    console.error(`negative control not caught: strata's ${a} equals llama.cpp's ${b}`);
  } else {
    console.log(`negative control: strata's ${a} differs from llama.cpp's ${b}, as it must`);
  }
}
process.exit(failed ? 1 : 0);
