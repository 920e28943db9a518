// bench_vs_llama.mjs - Strata's engine and llama.cpp side by side in one run, on the same GGUF
// files and the same tokens (issue 11 section 6; docs/BENCHMARKS.md, "Engine against llama.cpp").
//
//   node bench/bench_vs_llama.mjs [--build DIR (build)] [--dir SCRATCH] [--models LIST]
//        [--threads 1,2] [--runs R (3)] [--n-prompt N (512)] [--n-gen N (32)] [--quick] [--smoke]
//        [--state-only]
//
// LIST: comma-separated PRESET:TYPE, each written by strata-mkmodel (seeded weights, --arch
// taken from the preset) into SCRATCH (default $TMPDIR or /tmp, a folder of its own, removed
// afterwards), default qwen35-0.8b:Q8_0,qwen35-0.8b:Q4_K,llama-3.2-1b:Q4_K. For each model and
// thread count, `bench_engine --model` (Strata) and `node bench/bench_llama.mjs` (llama.cpp
// v0.4.0 through node-llama-cpp 3.21.1 of tests/ref) run one after the other, never at once, on
// the same token file; each engine is reported at its best thread count per figure. --quick:
// one run of each instead of R. --smoke: tiny presets, 32 prompt tokens, 4 decoded, 1 run, 1
// thread (the ctest bench_vs_llama_smoke: that the harness runs and prints its table; its
// figures mean nothing). --state-only: the state rows alone, quickly: each side reads the prompt
// and decodes once, at the largest of --threads only (the best on this VM), then runs the state
// paths R times; no prefill / decode rows. Exit 1 when a side fails on a file it should run; a
// model Strata refuses (a weight type it does not load) is reported as refused and the run goes
// on.
import {execFileSync, spawnSync} from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

const here = path.dirname(new URL(import.meta.url).pathname);

function usage(msg) {
    process.stderr.write(`bench_vs_llama: ${msg}\nusage: node bench/bench_vs_llama.mjs [--build DIR] ` +
        "[--dir SCRATCH] [--models PRESET:TYPE,...] [--threads 1,2] [--runs R] [--n-prompt N] " +
        "[--n-gen N] [--quick] [--smoke] [--state-only]\n");
    process.exit(2);
}

const a = {build: "build", dir: process.env.TMPDIR || "/tmp", threads: "1,2", runs: 3, nPrompt: 512,
           nGen: 32, models: "qwen35-0.8b:Q8_0,qwen35-0.8b:Q4_K,llama-3.2-1b:Q4_K"};
for (let i = 2; i < process.argv.length; i++) {
    const k = process.argv[i];
    if (k === "--quick") { a.runs = 1; continue; }
    if (k === "--state-only") { a.stateOnly = true; continue; }
    if (k === "--smoke") {
        Object.assign(a, {runs: 1, nPrompt: 32, nGen: 4, threads: "1", models: "qwen35-tiny:F32,tiny:Q8_0"});
        continue;
    }
    const v = process.argv[++i];
    if (v === undefined) usage(`${k} needs a value`);
    if (k === "--build") a.build = v;
    else if (k === "--dir") a.dir = v;
    else if (k === "--models") a.models = v;
    else if (k === "--threads") a.threads = v;
    else if (k === "--runs") a.runs = Number(v);
    else if (k === "--n-prompt") a.nPrompt = Number(v);
    else if (k === "--n-gen") a.nGen = Number(v);
    else usage(`unknown option ${k}`);
}
for (const k of ["runs", "nPrompt", "nGen"])
    if (!Number.isInteger(a[k]) || a[k] < 1) usage(`${k} needs a positive integer`);
let threads = a.threads.split(",").map(Number);
if (!threads.length || threads.some((t) => !Number.isInteger(t) || t < 1)) usage("--threads: positive integers");
if (a.stateOnly) threads = [Math.max(...threads)];
const models = a.models.split(",").map((m) => {
    const [preset, type] = m.split(":");
    if (!preset || !type) usage(`model "${m}" is not PRESET:TYPE`);
    const arch = preset === "tiny" || preset.startsWith("llama") ? "llama"
        : preset.startsWith("qwen35moe") ? "qwen35moe" : preset.startsWith("qwen3next") ? "qwen3next"
            : preset.startsWith("qwen35") ? "qwen35" : preset.startsWith("qwen3") ? "qwen3" : null;
    if (!arch) usage(`preset "${preset}": no architecture of this bench`);
    return {preset, type, arch};
});
const tools = path.resolve(a.build, "tools"), benchBin = path.resolve(a.build, "bench/bench_engine");
for (const f of [path.join(tools, "strata-mkmodel"), path.join(tools, "strata"), benchBin])
    if (!fs.existsSync(f)) usage(`${f} is missing (make build first)`);

fs.mkdirSync(a.dir, {recursive: true});
const scratch = fs.mkdtempSync(path.join(a.dir, "strata-bench-vs-llama-"));
process.on("exit", () => fs.rmSync(scratch, {recursive: true, force: true}));
for (const sig of ["SIGINT", "SIGTERM"]) process.on(sig, () => process.exit(130));

const load = () => os.loadavg().map((x) => x.toFixed(2)).join(" ");
const freeGB = () => { const s = fs.statfsSync(scratch); return s.bavail * s.bsize / 1e9; };
const cpu = (os.cpus()[0]?.model ?? "?").trim();
console.log(`bench_vs_llama: ${os.cpus().length} CPUs (${cpu}), ${(os.totalmem() / 2 ** 30).toFixed(1)} GiB; ` +
    `prompt ${a.nPrompt} tokens, ${a.nGen} decoded, best of ${a.runs} runs, threads ${threads.join(" and ")}` +
    `${a.stateOnly ? " (--state-only: the prompt read once, the state rows alone)" : ""}; ` +
    `load average ${load()}`);

function side(cmd, args) {
    const r = spawnSync(cmd, args, {encoding: "utf8", maxBuffer: 1 << 24});
    if (r.status === 0) {
        const line = r.stdout.trim().split("\n").pop();
        return {ok: JSON.parse(line)};
    }
    return {err: (r.stderr || r.stdout || `exit ${r.status}`).trim().split("\n").slice(-3).join(" / ")};
}

const fmtMB = (b) => (b / 1e6).toFixed(b < 1e6 ? 4 : 1);
const mbs = (f) => f.bytes / 1e6 / (f.ms / 1e3);
const fx = (x) => (Number.isFinite(x) ? `${x.toFixed(2)}x` : "-");

// best of the thread counts: highest rate / lowest time per figure, with its thread count
function bestRate(runs, get) {
    let b = null;
    for (const r of runs) { const v = get(r); if (v !== undefined && (!b || v > b.v)) b = {v, t: r.threads}; }
    return b;
}
function bestTime(runs, get) {
    let b = null;
    for (const r of runs) { const f = get(r); if (f && (!b || f.ms < b.f.ms)) b = {f, t: r.threads}; }
    return b;
}

// The vocabulary (tokenizer.ggml.tokens) and the tensor types of a GGUF file, from its header.
function ggufInfo(file) {
    const fd = fs.openSync(file, "r");
    let buf = Buffer.alloc(0), base = 0, off = 0;
    const need = (n) => {
        if (off + n <= buf.length) return;
        const keep = buf.subarray(off), more = Buffer.alloc(Math.max(n, 1 << 20));
        const got = fs.readSync(fd, more, 0, more.length, base + buf.length);
        base += off;
        buf = Buffer.concat([keep, more.subarray(0, got)]);
        off = 0;
        if (n > buf.length) throw new Error(`${file}: truncated GGUF header`);
    };
    const u32 = () => { need(4); const v = buf.readUInt32LE(off); off += 4; return v; };
    const u64 = () => { need(8); const v = Number(buf.readBigUInt64LE(off)); off += 8; return v; };
    const str = () => { const n = u64(); need(n); const v = buf.toString("utf8", off, off + n); off += n; return v; };
    const size = [1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8]; // GGUF value types 0..12 (8 string, 9 array)
    const skip = (t) => { if (t === 8) str(); else { need(size[t]); off += size[t]; } };
    try {
        if (u32() !== 0x46554747) throw new Error(`${file}: not a GGUF file`);
        u32();
        const nTensors = u64(), nKv = u64();
        let nVocab = 0;
        for (let i = 0; i < nKv; i++) {
            const key = str(), t = u32();
            if (t !== 9) { skip(t); continue; }
            const et = u32(), n = u64();
            if (key === "tokenizer.ggml.tokens") nVocab = n;
            for (let j = 0; j < n; j++) skip(et);
        }
        const names = {0: "f32", 1: "f16", 8: "q8_0", 12: "q4_K", 30: "bf16"}, count = {};
        for (let i = 0; i < nTensors; i++) {
            str();
            const nd = u32();
            for (let d = 0; d < nd; d++) u64();
            const t = u32();
            u64();
            const nm = names[t] ?? `type ${t}`;
            count[nm] = (count[nm] ?? 0) + 1;
        }
        if (!nVocab) throw new Error(`${file}: no tokenizer.ggml.tokens`);
        return {nVocab, types: Object.entries(count).map(([k, v]) => `${v} ${k}`).join(", ")};
    } finally {
        fs.closeSync(fd);
    }
}

let failed = 0;
const rows = [];
const pad = (s, n) => String(s).padEnd(n);
const padl = (s, n) => String(s).padStart(n);
function row(fig, st, ll, ratio, target, met) {
    rows.push(`  ${pad(fig, 52)} ${padl(st, 30)} ${padl(ll, 30)} ${padl(ratio, 16)} ${pad(target, 9)} ${met}`);
}
const met = (ok) => (ok ? "met" : "NOT met");

for (const m of models) {
    rows.length = 0;
    const file = path.join(scratch, `${m.preset}-${m.type}.gguf`);
    if (freeGB() < 12) {
        console.log(`\n${m.preset} ${m.type}: skipped, ${freeGB().toFixed(1)} GB free in ${scratch} (12 GB needed)`);
        continue;
    }
    execFileSync(path.join(tools, "strata-mkmodel"),
        ["--arch", m.arch, "--preset", m.preset, "--wtype", m.type, "-o", file], {stdio: ["ignore", "ignore", "pipe"]});
    const {nVocab, types} = ggufInfo(file);
    // the same tokens for both: ids spread over the vocabulary, deterministic
    const toks = [];
    for (let i = 0; i < a.nPrompt; i++) toks.push(1 + (i * 7919 + 13) % (nVocab - 1));
    const tf = path.join(scratch, "tokens.txt");
    fs.writeFileSync(tf, toks.join(",") + "\n");
    const fileMB = fs.statSync(file).size / 1e6;
    const loadBefore = load();
    const st = [], ll = [];
    let refused = null;
    for (const t of threads) {
        const common = ["--tokens-file", tf, "--n-gen", String(a.nGen), "--threads", String(t),
                        "--runs", String(a.runs), "--dir", scratch, ...(a.stateOnly ? ["--eval-runs", "1"] : [])];
        if (!refused) {
            const r = side(benchBin, ["--model", file, ...common]);
            if (r.ok) st.push(r.ok);
            else if (/bench_engine: load: /.test(r.err) && !st.length) refused = r.err;
            else { console.error(`bench_vs_llama: strata on ${file}, ${t} threads: ${r.err}`); failed = 1; }
        }
        const r = side(process.execPath, [path.join(here, "bench_llama.mjs"), "-m", file, ...common]);
        if (r.ok) ll.push(r.ok);
        else { console.error(`bench_vs_llama: llama.cpp on ${file}, ${t} threads: ${r.err}`); failed = 1; }
    }
    console.log(`\n${m.preset} ${m.type} (--arch ${m.arch}): ${fileMB.toFixed(1)} MB file (tensors: ${types}); ` +
        `context ${a.nPrompt + a.nGen}; load average ${loadBefore} before, ${load()} after`);
    if (refused) console.log(`  strata: refused the file: ${refused}`);
    for (const r of a.stateOnly ? [] : [...st, ...ll])
        console.log(`  ${pad(r.engine, 9)} ${r.threads} thread${r.threads > 1 ? "s" : " "}: prefill ` +
            `${r.prefill_tps.toFixed(1)} tok/s, decode ${r.decode_tps.toFixed(2)} tok/s, resident ` +
            `${r.rss_mb.toFixed(0)} MB (before loading ${r.rss_base_mb.toFixed(0)} MB, peak ${r.hwm_mb.toFixed(0)} MB)` +
            (r.flash_attention !== undefined ? `, flash attention ${r.flash_attention}` : ""));
    if (!ll.length) { fs.rmSync(file, {force: true}); continue; }
    if (!st.length) {
        // nothing to set beside llama.cpp's figures: they alone, one line
        const l = (k) => bestRate(ll, (r) => r[k]), s = bestTime(ll, (r) => r.save), d = bestTime(ll, (r) => r.load);
        console.log(`  llama.cpp alone: prefill ${l("prefill_tps").v.toFixed(2)} tok/s (${l("prefill_tps").t}T), decode ` +
            `${l("decode_tps").v.toFixed(2)} tok/s (${l("decode_tps").t}T); state file ${fmtMB(s.f.bytes)} MB, saved in ` +
            `${s.f.ms.toFixed(1)} ms (${mbs(s.f).toFixed(0)} MB/s), loaded in ${d.f.ms.toFixed(1)} ms (${mbs(d.f).toFixed(0)} MB/s)`);
        fs.rmSync(file, {force: true});
        continue;
    }
    row("figure", "strata", "llama.cpp", "ratio", "target", "");
    const rate = (runs, k) => bestRate(runs, (r) => r[k]);
    const rateCell = (b) => (b ? `${b.v.toFixed(2)} (${b.t}T)` : "-");
    for (const [k, name, target] of a.stateOnly ? [] : [["prefill_tps", `prefill tok/s, ${a.nPrompt} tokens`, 0.8],
                                                         ["decode_tps", "decode tok/s", 1.0]]) {
        const s = rate(st, k), l = rate(ll, k);
        const x = s && l ? s.v / l.v : NaN;
        row(name, rateCell(s), rateCell(l), fx(x), `>= ${target}x`, s ? met(x >= target) : "");
    }
    const lsave = bestTime(ll, (r) => r.save), lload = bestTime(ll, (r) => r.load);
    const cell = (b) => (b ? `${fmtMB(b.f.bytes)} MB ${b.f.ms.toFixed(1)} ms ${mbs(b.f).toFixed(0)} MB/s` : "-");
    // ratio of MB/s (the measure) and, after the slash, of time (llama.cpp's / Strata's)
    const xr = (s, l) => (s && l ? `${fx(mbs(s.f) / mbs(l.f))} / ${fx(l.f.ms / s.f.ms)}` : "-");
    const stateRows = (get, label) => {
        const g = (k) => bestTime(st, (r) => get(r)?.[k]);
        const p32 = bestTime(st, (r) => get(r)?.fp32?.park), pbf = bestTime(st, (r) => get(r)?.bf16?.park);
        for (const [c, p] of [["fp32", p32], ["bf16", pbf]])
            row(`PARK to RAM ${c}${label} vs save`, cell(p), cell(lsave), xr(p, lsave), ">= 4x",
                p ? met(mbs(p.f) / mbs(lsave.f) >= 4) : "");
        for (const c of ["fp32", "bf16"]) {
            const f = bestTime(st, (r) => get(r)?.[c]?.file_save);
            row(`session file SAVE ${c}${label} (durable)`, cell(f), cell(lsave), xr(f, lsave), ">= 0.8x",
                f ? met(mbs(f.f) / mbs(lsave.f) >= 0.8) : "");
            // the disk's own figures for the same bytes: what a durable SAVE can reach here
            const d = bestTime(st, (r) => get(r)?.[c]?.disk_durable);
            row(`  disk alone: those bytes durable`, cell(d), cell(lsave), xr(d, lsave), "", "");
            const w = bestTime(st, (r) => get(r)?.[c]?.disk_write);
            row(`  disk alone: those bytes, no fsync`, cell(w), cell(lsave), xr(w, lsave), "", "");
        }
        const fb = bestTime(st, (r) => get(r)?.bf16?.file_save);
        row(`session file bytes bf16${label}`, fb ? `${fmtMB(fb.f.bytes)} MB` : "-", `${fmtMB(lsave.f.bytes)} MB`,
            fb ? fx(fb.f.bytes / lsave.f.bytes) : "-", "<= 0.65x", fb ? met(fb.f.bytes / lsave.f.bytes <= 0.65) : "");
        // the bf16 file with its checkpoints compressed (zstd level 1, byte-shuffled): the K/V,
        // tokens and logits stay raw (the format compresses checkpoints only). Its bytes are fewer
        // than the state's, so its MB/s understates it: met is judged on the time ratio (the same
        // conversation saved / loaded in less or more time)
        const zs = bestTime(st, (r) => get(r)?.bf16?.file_save_z1);
        row(`session file SAVE bf16 zstd-1${label} (durable)`, cell(zs), cell(lsave), xr(zs, lsave), ">= 0.8x",
            zs ? met(lsave.f.ms / zs.f.ms >= 0.8) : "");
        const zd = bestTime(st, (r) => get(r)?.bf16?.disk_durable_z1);
        row(`  disk alone: those bytes durable`, cell(zd), cell(lsave), xr(zd, lsave), "", "");
        const zw = bestTime(st, (r) => get(r)?.bf16?.disk_write_z1);
        row(`  disk alone: those bytes, no fsync`, cell(zw), cell(lsave), xr(zw, lsave), "", "");
        row(`session file bytes bf16 zstd-1${label}`, zs ? `${fmtMB(zs.f.bytes)} MB` : "-", `${fmtMB(lsave.f.bytes)} MB`,
            zs ? fx(zs.f.bytes / lsave.f.bytes) : "-", "<= 0.65x", zs ? met(zs.f.bytes / lsave.f.bytes <= 0.65) : "");
        const zl = bestTime(st, (r) => get(r)?.bf16?.file_load_z1);
        row(`session file LOAD bf16 zstd-1${label} (verified)`, cell(zl), cell(lload), xr(zl, lload), ">= 1.0x",
            zl ? met(lload.f.ms / zl.f.ms >= 1.0) : "");
        for (const c of ["fp32", "bf16"]) {
            const f = bestTime(st, (r) => get(r)?.[c]?.file_load);
            row(`session file LOAD ${c}${label} (verified)`, cell(f), cell(lload), xr(f, lload), ">= 1.0x",
                f ? met(mbs(f.f) / mbs(lload.f) >= 1.0) : "");
        }
        for (const c of ["fp32", "bf16"]) {
            const f = bestTime(st, (r) => get(r)?.[c]?.restore_ram);
            row(`RESTORE from RAM ${c}${label} (verified)`, cell(f), cell(lload), xr(f, lload), "", "");
        }
        for (const c of ["fp32", "bf16"]) {
            const f = bestTime(st, (r) => get(r)?.[c]?.store_save);
            row(`store SAVE ${c}${label} (durable)`, cell(f), cell(lsave), xr(f, lsave), "", "");
            const g2 = bestTime(st, (r) => get(r)?.[c]?.store_load);
            row(`store RESTORE ${c}${label} (verified)`, cell(g2), cell(lload), xr(g2, lload), "", "");
        }
        return g;
    };
    stateRows((r) => r, "");
    stateRows((r) => r.cache_off, ", cache off");
    // what the default session file holds: the current state (the file of the same conversation
    // with the cache off) and the resume checkpoint a follow-up that diverges restores from
    const fon = bestTime(st, (r) => r.bf16?.file_save), foff = bestTime(st, (r) => r.cache_off?.bf16?.file_save);
    if (fon && foff)
        row("session file bytes bf16: state + checkpoint", `${fmtMB(foff.f.bytes)} + ${fmtMB(fon.f.bytes - foff.f.bytes)} MB`,
            `${fmtMB(lsave.f.bytes)} MB`, `${fx(foff.f.bytes / lsave.f.bytes)} + ${fx((fon.f.bytes - foff.f.bytes) / lsave.f.bytes)}`, "", "");
    const rs = st.length ? Math.max(...st.map((r) => r.rss_mb)) : NaN;
    const rl = Math.max(...ll.map((r) => r.rss_mb)), bl = Math.min(...ll.map((r) => r.rss_base_mb));
    row("resident memory after decode, MB", Number.isFinite(rs) ? rs.toFixed(0) : "-",
        `${rl.toFixed(0)} (node ${bl.toFixed(0)})`, Number.isFinite(rs) ? fx(rs / rl) : "-", "", "");
    console.log("  ratio: Strata / llama.cpp in MB/s, then llama.cpp's time / Strata's; nT: best at n threads");
    console.log(rows.join("\n"));
    fs.rmSync(file, {force: true});
}
process.exit(failed);
