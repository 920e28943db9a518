// llama_logits.mjs - llama.cpp v0.4.0 (node-llama-cpp 3.21.1, prebuilt CPU binaries) evaluates a
// GGUF on the given tokens by ARCHITECTURES.md Appendix A: CPU, F32 K/V, flash attention off,
// explicit threads, teacher forcing (controlledEvaluate with the full next-token distribution
// after every input token at temperature 1, no top-k / top-p / min-p).
//
//   node tests/ref/llama_logits.mjs -m MODEL (--tokens 1,2,3 | --tokens-file F) -o FILE
//        [--threads N (default 1)] [--kv-type F32|F16 (default F32)]
//
// FILE: [n_tokens][n_vocab] little-endian f32 LOG-PROBABILITIES (natural log of llama.cpp's
// softmax; a log-softmax of strata logits' output compares with it directly). Exit 0 on success,
// 1 on any failure (the message on stderr), 2 on bad arguments.
import fs from "node:fs";
import {refEval, refLlama} from "./logits_lib.mjs";

function usage(msg) {
    process.stderr.write(`llama_logits: ${msg}\nusage: node llama_logits.mjs -m MODEL ` +
        "(--tokens 1,2,3 | --tokens-file F) -o FILE [--threads N] [--kv-type F32|F16]\n");
    process.exit(2);
}

const a = {threads: 1, kvType: "F32"};
for (let i = 2; i < process.argv.length; i++) {
    const k = process.argv[i], v = process.argv[i + 1];
    if (v === undefined) usage(`${k} needs a value`);
    if (k === "-m") a.model = v;
    else if (k === "--tokens") a.tokens = v;
    else if (k === "--tokens-file") a.tokensFile = v;
    else if (k === "-o") a.out = v;
    else if (k === "--threads") a.threads = Number(v);
    else if (k === "--kv-type") a.kvType = v;
    else usage(`unknown option ${k}`);
    i++;
}
if (!a.model || !a.out || !a.tokens === !a.tokensFile) usage("-m, -o and one of --tokens, --tokens-file");
if (!Number.isInteger(a.threads) || a.threads < 1) usage("--threads needs a positive integer");
if (a.kvType !== "F32" && a.kvType !== "F16") usage("--kv-type F32 or F16");
const text = a.tokens ?? fs.readFileSync(a.tokensFile, "utf8");
const tokens = text.split(/[\s,]+/).filter((s) => s.length).map((s) => {
    if (!/^[0-9]+$/.test(s)) usage(`token "${s}" is not a number`);
    return Number(s);
});
if (!tokens.length) usage("no tokens");

try {
    const llama = await refLlama(a.threads);
    const {nVocab, rows} = await refEval(llama, a.model, [tokens], {threads: a.threads, kvType: a.kvType});
    fs.writeFileSync(a.out, Buffer.from(rows[0].buffer));
    process.stderr.write(`llama_logits: ${tokens.length} positions x ${nVocab} log-probabilities into ${a.out}\n`);
    await llama.dispose();
} catch (e) {
    process.stderr.write(`llama_logits: ${e.message ?? e}\n`);
    process.exit(1);
}
