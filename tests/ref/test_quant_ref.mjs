// test_quant_ref.mjs - quantized weights against llama.cpp v0.4.0 (ctest test_quant_ref; the
// wider sweep is test_quant_ref_sweep, label slow). For every architecture (llama, qwen3, qwen35,
// qwen35moe, qwen3next) on its tiny-q preset (every row length a multiple of 256, so the K-quants
// are used as such, not their fallbacks) and every type of Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS:
// the engine computes in f32 on the dequantized weights (docs/ENGINE.md, "Weight types"), so
// `strata logits` (F32 K/V) on the quantized file is held against llama.cpp on its F32 twin
// (`strata quantize q.gguf twin.gguf F32`: the very same dequantized values), max |d log-prob|
// <= 1e-3 at every position over the whole vocabulary; the engine on the twin must give the
// very bits it gives on the quantized file (the twin holds what the engine computes with). The
// mean KL and top-1 against llama.cpp on the quantized file itself (which quantizes the
// activations, ARCHITECTURES.md §3.7) are reported. Negative control, per architecture: the
// engine on the Q4_K file against llama.cpp on the f32 model it was quantized from must fail
// the limit (the comparison sees the quantization). The Qwen hybrids have key heads 2 != value
// heads 4 (their head-mapping controls are in test_engine_qwen35, llama's RoPE control in
// test_llama_ref).
//
//   node tests/ref/test_quant_ref.mjs BIN_DIR SCRATCH_DIR [--sweep]
// --sweep: three prompts, all twelve quantized types, and qwen3next's legacy ssm_in layout.
import {spawnSync} from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import {compareRows, refEval, refLlama} from "./logits_lib.mjs";

const args = process.argv.slice(2);
const sweep = args.includes("--sweep");
const [bin, dir] = args.filter((a) => a !== "--sweep");
if (!bin || !dir) {
    process.stderr.write("usage: node test_quant_ref.mjs BIN_DIR SCRATCH_DIR [--sweep]\n");
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

// Seeded token lists across the vocabulary of 512 (BOS first): 40 tokens, then 1 and 9.
function prompts() {
    let s = 12345;
    const rnd = () => (s = (s * 1103515245 + 12345) % 2147483648) % 512;
    const all = [[256, ...Array.from({length: 39}, rnd)], [256],
                 [256, 72, 101, 108, 108, 111, 44, 32, 83]];
    return sweep ? all : all.slice(0, 1);
}

function strataLogits(model, tokens, out) {
    run(path.join(bin, "strata"), ["logits", "-m", model, "--kv-dtype", "f32", "--threads", "1",
                                   "--backend", "cpu", "--tokens", tokens.join(","), "-o", out]);
    return fs.readFileSync(out);
}

const asF32 = (b) => new Float32Array(b.buffer, b.byteOffset, b.length / 4);

const archs = [["llama", "tiny-q"], ["qwen3", "tiny-q"], ["qwen35", "qwen35-tiny-q"],
               ["qwen35moe", "qwen35moe-tiny-q"], ["qwen3next", "qwen3next-tiny-q"]];
// The legacy layout with seed 8: seed 7's IQ4_NL file routes the last token of the 9-token
// prompt through a near-tie (layer 2, the second expert's router logit -0.0174076 against
// -0.0174081), which llama.cpp's own ~1e-6 differences flip (0.33 at that one position only).
if (sweep)
    archs.push(["qwen3next", "qwen3next-tiny-legacy", "8"]);
const types = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"];
if (sweep)
    types.push("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL");

const llama = await refLlama(1);
const ps = prompts();
let failed = 0;
const say = (s) => process.stdout.write(s + "\n");
for (const [arch, preset, seed = "7"] of archs) {
    const base = path.join(dir, `${arch}-${preset}`);
    run(path.join(bin, "strata-mkmodel"), ["--arch", arch, "--preset", preset, "--seed", seed, "-o",
                                           `${base}-f32.gguf`]);
    for (const type of types) {
        const q = `${base}-${type}.gguf`, twin = `${base}-${type}-twin.gguf`;
        run(path.join(bin, "strata"), ["quantize", `${base}-f32.gguf`, q, type]);
        run(path.join(bin, "strata"), ["quantize", q, twin, "F32"]);
        const info = run(path.join(bin, "strata"), ["info", "-m", q]).stdout;
        const typesLine = (info.match(/^types\s+(.*)$/m) || [, "?"])[1];
        const ref = await refEval(llama, twin, ps), same = await refEval(llama, q, ps);
        for (let i = 0; i < ps.length; i++) {
            const got = strataLogits(q, ps[i], path.join(dir, "s.bin"));
            const gotTwin = strataLogits(twin, ps[i], path.join(dir, "t.bin"));
            const r = compareRows(ref.rows[i], asF32(got), ref.nVocab);
            const s = compareRows(same.rows[i], asF32(got), ref.nVocab);
            const bits = got.equals(gotTwin);
            const ok = r.maxD <= 1e-3 && bits;
            failed += !ok;
            say(`${arch} ${preset} ${type} prompt ${i} (${ps[i].length} tokens) vs its f32 twin: max |dlogprob| ` +
                `${r.maxD.toExponential(3)} (position ${r.maxAt}), top-1 ${r.top1}/${r.n}; engine on the twin ` +
                `${bits ? "bit-identical" : "DIFFERENT"}: ${ok ? "PASS" : "FAIL"}; on the ${type} file itself: ` +
                `max |dlogprob| ${s.maxD.toExponential(3)}, mean KL ${s.meanKl.toExponential(3)}, ` +
                `top-1 ${s.top1}/${s.n}`);
        }
        say(`${arch} ${preset} ${type}: tensor types ${typesLine}`);
        if (type === "Q4_K") {
            const orig = await refEval(llama, `${base}-f32.gguf`, ps.slice(0, 1));
            const got = strataLogits(q, ps[0], path.join(dir, "s.bin"));
            const r = compareRows(orig.rows[0], asF32(got), orig.nVocab);
            const ok = r.maxD > 1e-3;
            failed += !ok;
            say(`${arch} ${preset} negative control (the Q4_K file against llama.cpp on the f32 model it was ` +
                `quantized from): max |dlogprob| ${r.maxD.toExponential(3)}: ` +
                `${ok ? "fails as it must" : "PASSES: the comparison does not discriminate"}`);
        }
        for (const f of [q, twin])
            fs.rmSync(f);
    }
}
await llama.dispose();
fs.rmSync(dir, {recursive: true, force: true});
say(failed ? `test_quant_ref: ${failed} check(s) failed` : "test_quant_ref: all passed");
process.exit(failed ? 1 : 0);
