// test_llama_ref.mjs - the engine against llama.cpp v0.4.0 on the same GGUF files (ctest
// test_llama_ref): for llama and qwen3, seeded tiny models (tied and untied embeddings, llama
// with rope_freqs) in F32, F16 and BF16, several prompts, `strata logits` with F32 K/V against
// llama.cpp (llama_logits' method): max |d log-prob| <= 1e-3 at every position over the whole
// vocabulary. The engine computes in f32 on the weights' values; llama.cpp rounds the activations
// of an F16 / BF16 matmul to F16 / BF16 (ARCHITECTURES.md §3.7). So an F16 / BF16 file is held
// against llama.cpp on its f32 twin (strata-mkmodel --f32-twin: the very same values stored as
// F32); the mean KL and top-1 against llama.cpp on the file itself are reported. Negative control: with STRATA_TEST_WRONG_ROPE=1 the engine uses the other RoPE
// pairing, and the comparison must fail by a wide margin (> 0.1).
//
//   node tests/ref/test_llama_ref.mjs BIN_DIR SCRATCH_DIR
import {spawnSync} from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import {fileURLToPath} from "node:url";

// The reference, or a failure saying how to get it (the comparison never skips); logits_lib is
// imported after the check, since it imports node-llama-cpp.
const refDir = path.dirname(fileURLToPath(import.meta.url));
if (!fs.existsSync(path.join(refDir, "node_modules", "node-llama-cpp", "package.json"))) {
    process.stderr.write(`test_llama_ref: the llama.cpp reference is missing ` +
                         `(${refDir}/node_modules): run \`make deps\`\n`);
    process.exit(1);
}
const {compareRows, refEval, refLlama} = await import("./logits_lib.mjs");

const [bin, dir] = process.argv.slice(2);
if (!bin || !dir) {
    process.stderr.write("usage: node test_llama_ref.mjs BIN_DIR SCRATCH_DIR\n");
    process.exit(2);
}
fs.rmSync(dir, {recursive: true, force: true});
fs.mkdirSync(dir, {recursive: true});

function run(cmd, args, env = {}) {
    const r = spawnSync(cmd, args, {encoding: "utf8", env: {...process.env, ...env}});
    if (r.status !== 0)
        throw new Error(`${cmd} ${args.join(" ")} exited ${r.status}: ${r.stderr}`);
    return r;
}

// Seeded token lists: 1, 9 and 40 tokens across the vocabulary (BOS first).
function prompts(V) {
    let s = 12345;
    const rnd = () => (s = (s * 1103515245 + 12345) % 2147483648) % V;
    return [[256], [256, 72, 101, 108, 108, 111, 44, 32, 83],
            [256, ...Array.from({length: 39}, rnd)]];
}

function strataLogits(model, tokens, out, env) {
    run(path.join(bin, "strata"), ["logits", "-m", model, "--kv-dtype", "f32", "--threads", "1",
                                   "--backend", "cpu", "--tokens", tokens.join(","), "-o", out], env);
    const b = fs.readFileSync(out);
    return new Float32Array(b.buffer, b.byteOffset, b.length / 4);
}

const cases = [];
for (const arch of ["llama", "qwen3"])
    for (const [wtype, preset] of [["f32", "tiny"], ["f16", "tiny-untied"], ["bf16", "tiny"]])
        cases.push({arch, wtype, preset});

const llama = await refLlama(1);
let failed = 0;
for (const c of cases) {
    const model = path.join(dir, `${c.arch}-${c.preset}-${c.wtype}.gguf`);
    run(path.join(bin, "strata-mkmodel"), ["--arch", c.arch, "--preset", c.preset, "--wtype", c.wtype,
                                           "--seed", "7", "-o", model]);
    let twin = model, same = null;
    if (c.wtype !== "f32") {
        twin = model.replace(/\.gguf$/, "-f32twin.gguf");
        run(path.join(bin, "strata-mkmodel"), ["--arch", c.arch, "--preset", c.preset, "--wtype", c.wtype,
                                               "--f32-twin", "--seed", "7", "-o", twin]);
        same = await refEval(llama, model, prompts(512));
    }
    const ref = await refEval(llama, twin, prompts(512));
    const ps = prompts(ref.nVocab);
    for (let i = 0; i < ps.length; i++) {
        const got = strataLogits(model, ps[i], path.join(dir, "s.bin"));
        const r = compareRows(ref.rows[i], got, ref.nVocab);
        const ok = r.maxD <= 1e-3;
        failed += !ok;
        let also = "";
        if (same) {
            const q = compareRows(same.rows[i], got, ref.nVocab);
            also = `; on the ${c.wtype} file itself: max |dlogprob| ${q.maxD.toExponential(3)}, ` +
                   `mean KL ${q.meanKl.toExponential(3)}, top-1 ${q.top1}/${q.n}`;
        }
        process.stdout.write(`${c.arch} ${c.preset} ${c.wtype} prompt ${i} (${ps[i].length} tokens)` +
                             `${same ? " vs its f32 twin" : ""}: max |dlogprob| ${r.maxD.toExponential(3)} ` +
                             `(position ${r.maxAt}), mean KL ${r.meanKl.toExponential(3)}, top-1 ${r.top1}/${r.n}: ` +
                             `${ok ? "PASS" : "FAIL"}${also}\n`);
    }
    if (c.wtype === "f32") {
        const last = ps.length - 1;
        const wrong = strataLogits(model, ps[last], path.join(dir, "w.bin"), {STRATA_TEST_WRONG_ROPE: "1"});
        const r = compareRows(ref.rows[last], wrong, ref.nVocab);
        const ok = r.maxD > 0.1;
        failed += !ok;
        process.stdout.write(`${c.arch} negative control (the other RoPE pairing): max |dlogprob| ` +
                             `${r.maxD.toExponential(3)}: ${ok ? "fails as it must" : "PASSES: the comparison does not discriminate"}\n`);
    }
}
await llama.dispose();
fs.rmSync(dir, {recursive: true, force: true});
process.stdout.write(failed ? `test_llama_ref: ${failed} check(s) failed\n` : "test_llama_ref: all passed\n");
process.exit(failed ? 1 : 0);
