// compare_logits.mjs - compare two [n_tokens][n_vocab] little-endian f32 files position by
// position over the whole vocabulary, on log-softmax (so logits and log-probabilities compare
// alike): REF is the reference (llama_logits.mjs), TEST the engine (strata logits).
//
//   node tests/ref/compare_logits.mjs REF TEST --n-vocab V [--max-dlogprob X (default 1e-3)]
//        [--max-kl X] [--min-top1 F] [--quiet]
//
// Prints per position the max |Δ log-prob|, KL(ref || test) and whether the top-1 tokens agree,
// then the max over positions, the mean KL and the top-1 agreement. Exit 0 when every position's
// max |Δ log-prob| <= --max-dlogprob (and the mean KL <= --max-kl, the top-1 agreement >=
// --min-top1 where given); 1 when not; 2 on bad arguments or files (sizes that differ, a size
// that is not a multiple of n_vocab, a value that is not finite).
import fs from "node:fs";
import {compareRows} from "./logits_lib.mjs";

function die(msg) {
    process.stderr.write(`compare_logits: ${msg}\n`);
    process.exit(2);
}

const pos = [], o = {maxD: 1e-3, maxKl: null, minTop1: null, quiet: false};
for (let i = 2; i < process.argv.length; i++) {
    const k = process.argv[i];
    if (k === "--quiet") { o.quiet = true; continue; }
    if (!k.startsWith("--")) { pos.push(k); continue; }
    const v = Number(process.argv[++i]);
    if (!Number.isFinite(v)) die(`${k} needs a number`);
    if (k === "--n-vocab") o.nVocab = v;
    else if (k === "--max-dlogprob") o.maxD = v;
    else if (k === "--max-kl") o.maxKl = v;
    else if (k === "--min-top1") o.minTop1 = v;
    else die(`unknown option ${k}`);
}
if (pos.length !== 2 || !Number.isInteger(o.nVocab) || o.nVocab < 1)
    die("usage: compare_logits.mjs REF TEST --n-vocab V [--max-dlogprob X] [--max-kl X] [--min-top1 F] [--quiet]");

function load(path) {
    const b = fs.readFileSync(path);
    if (b.length === 0 || b.length % (4 * o.nVocab)) die(`${path}: ${b.length} bytes, not rows of ${o.nVocab} f32`);
    const f = new Float32Array(b.buffer, b.byteOffset, b.length / 4);
    for (let i = 0; i < f.length; i++)
        if (!Number.isFinite(f[i])) die(`${path}: value ${i} (position ${Math.floor(i / o.nVocab)}) is ${f[i]}`);
    return f;
}

const ref = load(pos[0]), test = load(pos[1]), V = o.nVocab;
if (ref.length !== test.length) die(`${pos[0]} holds ${ref.length / V} positions, ${pos[1]} ${test.length / V}`);
let c;
try {
    c = compareRows(ref, test, V);
} catch (e) {
    die(e.message);
}
if (!o.quiet)
    c.pos.forEach((p, r) => process.stdout.write(`position ${r}: max |dlogprob| ${p.maxD.toExponential(3)}, KL ${p.kl.toExponential(3)}, top-1 ${p.same ? "same" : "differs"}\n`));
const ok = c.maxD <= o.maxD && (o.maxKl === null || c.meanKl <= o.maxKl) &&
           (o.minTop1 === null || c.top1 / c.n >= o.minTop1);
process.stdout.write(`compare_logits: ${c.n} positions x ${V}: max |dlogprob| ${c.maxD.toExponential(3)} ` +
                     `(position ${c.maxAt}, limit ${o.maxD}), mean KL ${c.meanKl.toExponential(3)}, ` +
                     `top-1 ${c.top1}/${c.n}: ${ok ? "PASS" : "FAIL"}\n`);
process.exit(ok ? 0 : 1);
