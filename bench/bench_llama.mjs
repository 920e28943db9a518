// bench_llama.mjs - llama.cpp v0.4.0 (node-llama-cpp 3.21.1, prebuilt CPU binaries) on the side
// of bench_engine --model: the same GGUF, the same prompt tokens, the same context; prints one
// JSON line with the figures bench_vs_llama.mjs sets side by side (docs/BENCHMARKS.md).
//
//   node bench/bench_llama.mjs -m MODEL --tokens-file F --n-gen N --threads T --runs R --dir DIR
//        [--eval-runs E (R)]
//
// Per run: a cleared sequence reads the prompt (one batch; the first token sampled, greedy) and
// then generates N tokens one at a time (each fed back and read: N forward passes). Then the
// sequence's state is saved with saveStateToFile (no fsync: what node-llama-cpp does) and
// loaded again with loadStateFromFile (unverified: llama.cpp trusts the file) R times each (the
// prompt is read E times; bench_vs_llama --state-only passes 1).
// Best of R for every figure. Resident memory (VmRSS of this process) before the model is
// loaded and after the runs. Exit 0 on success, 1 on failure (message on stderr).
import fs from "node:fs";
import path from "node:path";
import {performance} from "node:perf_hooks";
import {createRequire} from "node:module";

const here = path.dirname(new URL(import.meta.url).pathname);
const require = createRequire(path.join(here, "../tests/ref/package.json"));
const {getLlama, LlamaLogLevel} = await import(require.resolve("node-llama-cpp"));

function usage(msg) {
    process.stderr.write(`bench_llama: ${msg}\nusage: node bench_llama.mjs -m MODEL --tokens-file F ` +
        "--n-gen N --threads T --runs R --dir DIR [--eval-runs E]\n");
    process.exit(2);
}

const a = {nGen: 32, threads: 1, runs: 3};
for (let i = 2; i < process.argv.length; i += 2) {
    const k = process.argv[i], v = process.argv[i + 1];
    if (v === undefined) usage(`${k} needs a value`);
    if (k === "-m") a.model = v;
    else if (k === "--tokens-file") a.tokensFile = v;
    else if (k === "--n-gen") a.nGen = Number(v);
    else if (k === "--threads") a.threads = Number(v);
    else if (k === "--runs") a.runs = Number(v);
    else if (k === "--eval-runs") a.evalRuns = Number(v);
    else if (k === "--dir") a.dir = v;
    else usage(`unknown option ${k}`);
}
if (!a.model || !a.tokensFile || !a.dir) usage("-m, --tokens-file and --dir are needed");
a.evalRuns ??= a.runs;
for (const k of ["nGen", "threads", "runs", "evalRuns"])
    if (!Number.isInteger(a[k]) || a[k] < 1) usage(`${k} needs a positive integer`);

function rssMb(field = "VmRSS") {
    const m = fs.readFileSync("/proc/self/status", "utf8").match(new RegExp(`^${field}:\\s+(\\d+) kB`, "m"));
    return m ? Number(m[1]) / 1024 : 0;
}

const tokens = fs.readFileSync(a.tokensFile, "utf8").split(/[\s,]+/).filter((s) => s.length).map(Number);
if (!tokens.length || tokens.some((t) => !Number.isInteger(t) || t < 0)) usage("bad tokens file");
const nCtx = tokens.length + a.nGen;

try {
    const rssBase = rssMb();
    const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error,
                                  maxThreads: a.threads});
    const model = await llama.loadModel({modelPath: a.model, gpuLayers: 0});
    const ctx = await model.createContext({
        contextSize: nCtx, batchSize: tokens.length, threads: {ideal: a.threads, min: a.threads},
    });
    const seq = ctx.getSequence();
    const out = {engine: "llama.cpp", threads: a.threads, n_prompt: tokens.length, n_gen: a.nGen,
                 n_ctx: ctx.contextSize, flash_attention: ctx.flashAttention, rss_base_mb: rssBase};
    let bestPrefill = Infinity, bestDecode = Infinity;
    for (let r = 0; r < a.evalRuns; r++) {
        await seq.clearHistory();
        const gen = seq.evaluate(tokens, {temperature: 0});
        let t = performance.now();
        let next = await gen.next();
        bestPrefill = Math.min(bestPrefill, performance.now() - t);
        t = performance.now();
        for (let i = 0; i < a.nGen && !next.done; i++) next = await gen.next();
        bestDecode = Math.min(bestDecode, performance.now() - t);
        await gen.return();
        if (seq.nextTokenIndex !== nCtx)
            throw new Error(`the sequence holds ${seq.nextTokenIndex} tokens after decoding, not ${nCtx}`);
    }
    out.prefill_tps = tokens.length / (bestPrefill / 1e3);
    out.decode_tps = a.nGen / (bestDecode / 1e3);
    out.rss_mb = rssMb();
    const file = path.join(a.dir, "llama-state.bin");
    let bestSave = Infinity, bestLoad = Infinity, bytes = 0;
    for (let r = 0; r < a.runs; r++) {
        const t = performance.now();
        const {fileSize} = await seq.saveStateToFile(file);
        bestSave = Math.min(bestSave, performance.now() - t);
        bytes = fileSize;
    }
    for (let r = 0; r < a.runs; r++) {
        const t = performance.now();
        await seq.loadStateFromFile(file, {acceptRisk: true});
        bestLoad = Math.min(bestLoad, performance.now() - t);
        if (seq.nextTokenIndex !== nCtx)
            throw new Error(`the loaded state holds ${seq.nextTokenIndex} tokens, not ${nCtx}`);
    }
    fs.unlinkSync(file);
    out.save = {bytes, ms: bestSave};
    out.load = {bytes, ms: bestLoad};
    out.hwm_mb = rssMb("VmHWM");
    await ctx.dispose();
    await model.dispose();
    await llama.dispose();
    process.stdout.write(JSON.stringify(out) + "\n");
} catch (e) {
    process.stderr.write(`bench_llama: ${e.stack ?? e}\n`);
    process.exit(1);
}
