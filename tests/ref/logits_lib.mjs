// logits_lib.mjs - what llama_logits.mjs, compare_logits.mjs and test_llama_ref.mjs share: the
// reference evaluation by ARCHITECTURES.md Appendix A and the comparison on log-softmax.
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

// llama.cpp v0.4.0 on the CPU (prebuilt, never built here) with exactly `threads` threads.
export async function refLlama(threads) {
    return getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error, maxThreads: threads});
}

// For each token list of `prompts` (a fresh context each): the log-probabilities after every
// token (teacher forcing; temperature 1, no top-k / top-p / min-p), F32 K/V (or kvType), flash
// attention off. Returns {nVocab, rows: [Float32Array(n_tokens * nVocab)]}.
export async function refEval(llama, modelPath, prompts, {threads = 1, kvType = "F32"} = {}) {
    const model = await llama.loadModel({modelPath, gpuLayers: 0});
    try {
        const nVocab = model.fileInfo.metadata?.tokenizer?.ggml?.tokens?.length;
        if (!nVocab) throw new Error(`${modelPath}: no tokenizer.ggml.tokens`);
        const rows = [];
        for (const tokens of prompts) {
            for (const t of tokens)
                if (t >= nVocab) throw new Error(`token ${t} is beyond the vocabulary (${nVocab})`);
            const n = Math.max(32, tokens.length + 1);
            const ctx = await model.createContext({
                contextSize: n, batchSize: n, threads: {ideal: threads, min: threads},
                flashAttention: false, experimentalKvCacheKeyType: kvType,
                experimentalKvCacheValueType: kvType,
            });
            try {
                const opts = {temperature: 1, topK: 0, topP: 1, minP: 0};
                const res = await ctx.getSequence().controlledEvaluate(
                    tokens.map((t) => [t, {generateNext: {probabilities: true, options: opts}}]));
                const out = new Float32Array(tokens.length * nVocab);
                for (let i = 0; i < tokens.length; i++) {
                    const p = res[i]?.next?.probabilities;
                    if (!p || p.size !== nVocab)
                        throw new Error(`position ${i}: ${p ? p.size : 0} probabilities, the vocabulary has ${nVocab}`);
                    for (const [tok, prob] of p) out[i * nVocab + tok] = Math.log(prob);
                }
                rows.push(out);
            } finally {
                await ctx.dispose();
            }
        }
        return {nVocab, rows};
    } finally {
        await model.dispose();
    }
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

// ref and test: [n][V] f32 (logits or log-probabilities alike: both go through log-softmax).
// Per position: max |d log-prob| over the vocabulary, KL(ref || test), top-1 agreement; and
// their summary. Throws on different sizes or a value that is not finite.
export function compareRows(ref, test, V) {
    if (ref.length !== test.length || ref.length % V || !ref.length)
        throw new Error(`sizes ${ref.length} and ${test.length} are not the same rows of ${V}`);
    for (const [f, nm] of [[ref, "reference"], [test, "test"]])
        for (let i = 0; i < f.length; i++)
            if (!Number.isFinite(f[i])) throw new Error(`${nm} value ${i} (position ${Math.floor(i / V)}) is ${f[i]}`);
    const n = ref.length / V, pos = [];
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
        pos.push({maxD: d, kl, same});
    }
    return {n, pos, maxD: worst, maxAt: worstAt, meanKl: klSum / n, top1: agree};
}
