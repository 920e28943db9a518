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

function logSoftmax(f, r, V) {
    const out = new Float64Array(V);
    let m = -Infinity;
    for (let j = 0; j < V; j++) m = Math.max(m, f[r * V + j]);
    let s = 0;
    for (let j = 0; j < V; j++) s += Math.exp(f[r * V + j] - m);
    const lse = m + Math.log(s);
    for (let j = 0; j < V; j++) out[j] = f[r * V + j] - lse;
    return out;
}

function argmax(a) {
    let b = 0;
    for (let j = 1; j < a.length; j++) if (a[j] > a[b]) b = j;
    return b;
}

const ref = load(pos[0]), test = load(pos[1]), V = o.nVocab;
if (ref.length !== test.length) die(`${pos[0]} holds ${ref.length / V} positions, ${pos[1]} ${test.length / V}`);
const n = ref.length / V;
let worst = 0, worstAt = 0, klSum = 0, agree = 0;
for (let r = 0; r < n; r++) {
    const a = logSoftmax(ref, r, V), b = logSoftmax(test, r, V);
    let d = 0, kl = 0;
    for (let j = 0; j < V; j++) {
        d = Math.max(d, Math.abs(a[j] - b[j]));
        kl += Math.exp(a[j]) * (a[j] - b[j]);
    }
    const same = argmax(a) === argmax(b);
    agree += same;
    klSum += kl;
    if (d > worst) { worst = d; worstAt = r; }
    if (!o.quiet)
        process.stdout.write(`position ${r}: max |dlogprob| ${d.toExponential(3)}, KL ${kl.toExponential(3)}, top-1 ${same ? "same" : "differs"}\n`);
}
const meanKl = klSum / n;
const ok = worst <= o.maxD && (o.maxKl === null || meanKl <= o.maxKl) &&
           (o.minTop1 === null || agree / n >= o.minTop1);
process.stdout.write(`compare_logits: ${n} positions x ${V}: max |dlogprob| ${worst.toExponential(3)} ` +
                     `(position ${worstAt}, limit ${o.maxD}), mean KL ${meanKl.toExponential(3)}, ` +
                     `top-1 ${agree}/${n}: ${ok ? "PASS" : "FAIL"}\n`);
process.exit(ok ? 0 : 1);
