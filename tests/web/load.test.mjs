// Bounded load test of `ptllm serve` from a second process (Node's fetch, loopback only).
//
//   PTLLM_URL=http://127.0.0.1:PORT/ node load.test.mjs
//
// 200 POST /api/generate (16 tokens each: greedy and seeded, every 20th streamed and read to
// the end), 8 in flight, with GET /api/status and /api/caps interleaved. Every response must
// be 200 and well-formed, identical greedy requests must return identical text (and identical
// seeded ones too). Then a handful of bad requests (each must be a 4xx with {"error": ...}),
// and the server must still be healthy and give the same greedy text afterwards.
// Also: 32 event streams open at once, the 33rd refused (503), the slots free again after.
// Bounded: 200 requests, 30 s per request, 150 s in all.

const BASE = (process.env.PTLLM_URL || '').replace(/\/?$/, '/');
const TOTAL = Number(process.env.PTLLM_LOAD_REQUESTS || 200);
const CONCURRENCY = Number(process.env.PTLLM_LOAD_CONCURRENCY || 8);
const TOKENS = 16;
const GLOBAL_TIMEOUT_MS = 150000;

if (!process.env.PTLLM_URL) {
  console.error('load.test: set PTLLM_URL (e.g. http://127.0.0.1:8080/)');
  process.exit(2);
}

let passed = 0;
const failures = [];
const t0 = performance.now();
const secs = () => ((performance.now() - t0) / 1000).toFixed(1) + 's';
function ok(msg) {
  passed++;
  console.log(`ok ${passed} - ${msg} [${secs()}]`);
}
function fail(msg) {
  failures.push(msg);
  console.error(`FAIL: ${msg}`);
}

setTimeout(() => {
  console.error(`FAIL: load test exceeded its global timeout of ${GLOBAL_TIMEOUT_MS / 1000}s`);
  console.log(`load: ${passed} passed, ${failures.length + 1} failed`);
  process.exit(1);
}, GLOBAL_TIMEOUT_MS).unref();

const url = (p) => new URL(p.replace(/^\//, ''), BASE);

async function request(method, path, body, {raw = false, timeoutMs = 30000} = {}) {
  const init = {method, signal: AbortSignal.timeout(timeoutMs), headers: {}};
  if (body !== undefined) {
    init.body = raw ? body : JSON.stringify(body);
    init.headers['Content-Type'] = 'application/json';
  }
  const res = await fetch(url(path), init);
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch (_) { /* checked by callers */ }
  return {status: res.status, type: res.headers.get('content-type') || '', text, json};
}

// Parse a whole text/event-stream body into [{event, data}].
function parseSse(text) {
  const events = [];
  let type = '';
  let data = [];
  for (const line of text.split(/\r\n|\r|\n/)) {
    if (line === '') {
      if (data.length) events.push({event: type || 'message', data: data.join('\n')});
      type = '';
      data = [];
      continue;
    }
    if (line[0] === ':') continue;
    const i = line.indexOf(':');
    const field = i < 0 ? line : line.slice(0, i);
    let value = i < 0 ? '' : line.slice(i + 1);
    if (value[0] === ' ') value = value.slice(1);
    if (field === 'event') type = value;
    else if (field === 'data') data.push(value);
  }
  if (data.length) events.push({event: type || 'message', data: data.join('\n')});
  return events;
}

function checkDone(j, spec, where) {
  const errs = [];
  if (!j || typeof j !== 'object') return [`${where}: body is not a JSON object`];
  if (typeof j.text !== 'string') errs.push(`${where}: text is ${typeof j.text}`);
  if (j.tokens !== TOKENS) errs.push(`${where}: tokens ${j.tokens}, asked ${TOKENS}`);
  if (typeof j.path !== 'string' || !j.path) errs.push(`${where}: path ${JSON.stringify(j.path)}`);
  if (j.model !== 'base') errs.push(`${where}: model ${JSON.stringify(j.model)}`);
  for (const k of ['ms', 'tok_s', 'queued_ms']) {
    if (typeof j[k] !== 'number' || !Number.isFinite(j[k]) || j[k] < 0) errs.push(`${where}: ${k} ${JSON.stringify(j[k])}`);
  }
  if (spec.path === 'f32' && j.path !== 'f32') errs.push(`${where}: asked path f32, got ${j.path}`);
  return errs;
}

const PROMPTS = ['ROMEO:', 'JULIET:\nO', 'First Citizen:\nBefore we proceed', 'KING RICHARD III:\n'];

function specFor(i) {
  const prompt = PROMPTS[i % PROMPTS.length];
  const greedy = i % 2 === 0;
  const spec = greedy
    ? {prompt, tokens: TOKENS, temperature: 0}
    : {prompt, tokens: TOKENS, temperature: 0.9, top_k: 40, top_p: 0.95, seed: 1000 + (i % 3)};
  if (i % 10 === 5) spec.path = 'f32';
  else if (i % 10 === 7) spec.path = 'auto';
  if (i % 20 === 3 || i % 20 === 14) spec.stream = true;
  return spec;
}
// identical requests must give identical text: the key leaves out stream and path (greedy is
// greedy on any gated path; the seeded ones are compared per path)
const keyOf = (s) => JSON.stringify([s.prompt, s.temperature, s.top_k ?? null, s.top_p ?? null, s.seed ?? null,
  s.temperature === 0 ? '' : (s.path || 'auto')]);

async function oneGenerate(i, results, latencies) {
  const spec = specFor(i);
  const where = `request #${i} ${JSON.stringify(spec)}`;
  const t = performance.now();
  const r = await request('POST', '/api/generate', spec);
  latencies.push(performance.now() - t);
  if (r.status !== 200) return fail(`${where}: status ${r.status} ${r.text.slice(0, 200)}`);
  if (spec.stream) {
    if (!r.type.startsWith('text/event-stream')) return fail(`${where}: content-type ${r.type}`);
    const ev = parseSse(r.text);
    const names = ev.map((e) => e.event);
    if (names[0] !== 'start' || names[names.length - 1] !== 'done') return fail(`${where}: events ${names.join(',')}`);
    const tokens = ev.filter((e) => e.event === 'token');
    if (tokens.length !== TOKENS) return fail(`${where}: ${tokens.length} token events`);
    if (ev.length !== TOKENS + 2) return fail(`${where}: unexpected events ${names.join(',')}`);
    let start, done, joined = '';
    try {
      start = JSON.parse(ev[0].data);
      done = JSON.parse(ev[ev.length - 1].data);
      for (const tk of tokens) joined += JSON.parse(tk.data).text;
    } catch (e) {
      return fail(`${where}: malformed event data: ${e.message}`);
    }
    if (typeof start.path !== 'string' || start.model !== 'base') return fail(`${where}: start ${JSON.stringify(start)}`);
    const errs = checkDone(done, spec, where + ' done');
    if (errs.length) return errs.forEach(fail);
    if (joined !== done.text) return fail(`${where}: token events ${JSON.stringify(joined)} != done.text ${JSON.stringify(done.text)}`);
    results.push({i, spec, text: done.text, path: done.path});
  } else {
    if (!r.type.startsWith('application/json')) return fail(`${where}: content-type ${r.type}`);
    const errs = checkDone(r.json, spec, where);
    if (errs.length) return errs.forEach(fail);
    results.push({i, spec, text: r.json.text, path: r.json.path});
  }
}

async function oneSide(k, counts) {
  const path = k % 2 ? '/api/caps' : '/api/status';
  const r = await request('GET', path);
  counts.side++;
  if (r.status !== 200 || !r.json) return fail(`GET ${path}: ${r.status} ${r.text.slice(0, 200)}`);
  if (path === '/api/status' && (typeof r.json.line !== 'string' || typeof r.json.ready !== 'boolean' || typeof r.json.queue !== 'number')) {
    return fail(`GET /api/status malformed: ${r.text.slice(0, 200)}`);
  }
  if (path === '/api/caps' && (!Array.isArray(r.json.paths) || !Array.isArray(r.json.pills))) {
    return fail(`GET /api/caps malformed: ${r.text.slice(0, 200)}`);
  }
}

async function waitReady() {
  const deadline = Date.now() + 60000;
  for (;;) {
    const r = await request('GET', '/api/status').catch((e) => ({status: 0, text: String(e)}));
    if (r.status === 200 && r.json && r.json.ready) return r.json;
    if (Date.now() > deadline) throw new Error(`server not ready after 60s: ${r.status} ${r.text.slice(0, 200)}`);
    await new Promise((res) => setTimeout(res, 250));
  }
}

async function expectError(name, method, path, body, wantStatus, {raw = false, mustMention} = {}) {
  let r;
  try {
    r = await request(method, path, body, {raw});
  } catch (e) {
    return fail(`bad request "${name}": ${e.message}`);
  }
  const want = Array.isArray(wantStatus) ? wantStatus : [wantStatus];
  if (!want.includes(r.status)) return fail(`bad request "${name}": status ${r.status} (want ${want.join('/')}), body ${r.text.slice(0, 200)}`);
  if (!r.json || typeof r.json.error !== 'string' || !r.json.error) return fail(`bad request "${name}": ${r.status} without {"error": ...}: ${r.text.slice(0, 200)}`);
  if (mustMention && !mustMention.some((m) => r.json.error.includes(m))) {
    return fail(`bad request "${name}": error does not name ${mustMention.join(' or ')}: "${r.json.error}"`);
  }
  ok(`bad request "${name}" → ${r.status} {"error": "${r.json.error}"}`);
}

async function openStream() {
  const ctrl = new AbortController();
  const timer = setTimeout(() => ctrl.abort(), 20000);
  const res = await fetch(url('/api/events'), {signal: ctrl.signal, headers: {Accept: 'text/event-stream'}});
  const close = () => { clearTimeout(timer); ctrl.abort(); };
  if (res.status !== 200) {
    const text = await res.text().catch(() => '');
    close();
    return {status: res.status, text, close};
  }
  // read until the hello event is complete, so the server has counted this subscriber
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = '';
  while (!/event: hello\r?\n[^]*?\r?\n\r?\n/.test(buf)) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += dec.decode(value, {stream: true});
  }
  return {status: 200, text: buf, close: () => { reader.cancel().catch(() => {}); close(); }};
}

async function subscriberLimit(info) {
  const max = 32;
  const streams = [];
  try {
    for (let i = 0; i < max; i++) {
      const s = await openStream();
      if (s.status !== 200) return fail(`event stream ${i + 1} of ${max}: status ${s.status} ${s.text.slice(0, 200)}`);
      if (!s.text.includes('event: hello')) return fail(`event stream ${i + 1}: no hello event`);
      streams.push(s);
    }
    const extra = await openStream();
    let j = null;
    try { j = JSON.parse(extra.text); } catch (_) { /* checked below */ }
    if (extra.status !== 503 || !j || typeof j.error !== 'string') fail(`event stream ${max + 1}: status ${extra.status} ${extra.text.slice(0, 200)} (want 503 {"error": ...})`);
    else ok(`${max} event streams open; stream #${max + 1} → 503 {"error": "${j.error}"}`);
    const st = await request('GET', '/api/status', undefined, {timeoutMs: 5000});
    const g = await request('POST', '/api/generate', {prompt: 'ROMEO:', tokens: 4, temperature: 0}, {timeoutMs: 10000});
    if (st.status !== 200 || g.status !== 200) fail(`with ${max} event streams open: status ${st.status}, generate ${g.status}`);
    else ok(`with ${max} event streams open the server still answers status and generate`);
  } finally {
    for (const s of streams) s.close();
  }
  // the slots come back once the clients are gone (bounded wait: the server may notice a
  // closed stream only when it next writes to it, the 15 s keep-alive)
  const tClosed = Date.now();
  const deadline = tClosed + 35000;
  for (;;) {
    const s = await openStream().catch((e) => ({status: 0, text: String(e), close() {}}));
    s.close();
    if (s.status === 200) {
      ok(`event-stream slots are free again ${((Date.now() - tClosed) / 1000).toFixed(1)}s after the clients disconnected`);
      break;
    }
    if (Date.now() > deadline) {
      fail(`event streams still refused 35s after all clients disconnected: ${s.status} ${s.text.slice(0, 120)}`);
      break;
    }
    await new Promise((r) => setTimeout(r, 250));
  }
  void info;
}

async function main() {
  const st = await waitReady();
  ok(`server ready: "${st.line}"`);

  // --- the load ---
  const results = [];
  const latencies = [];
  const counts = {side: 0};
  let next = 0;
  let sideK = 0;
  const tLoad = performance.now();
  async function worker() {
    for (;;) {
      const i = next++;
      if (i >= TOTAL) return;
      await oneGenerate(i, results, latencies).catch((e) => fail(`request #${i}: ${e.message}`));
      if (i % 5 === 4) await oneSide(sideK++, counts).catch((e) => fail(`side request: ${e.message}`));
    }
  }
  await Promise.all(Array.from({length: CONCURRENCY}, worker));
  const loadS = (performance.now() - tLoad) / 1000;
  const n = results.length;
  latencies.sort((a, b) => a - b);
  const pct = (q) => latencies.length ? latencies[Math.min(latencies.length - 1, Math.floor(q * latencies.length))].toFixed(0) : '-';
  console.log(`load: ${TOTAL} generate requests (${TOTAL * TOKENS} tokens) + ${counts.side} status/caps requests, ` +
    `${CONCURRENCY} in flight: ${loadS.toFixed(2)}s, ${(TOTAL / loadS).toFixed(1)} generate req/s, ` +
    `${((TOTAL + counts.side) / loadS).toFixed(1)} req/s in all, ${(n * TOKENS / loadS).toFixed(0)} tok/s; ` +
    `latency p50 ${pct(0.5)} ms, p95 ${pct(0.95)} ms, max ${pct(1)} ms`);
  if (n === TOTAL && failures.length === 0) ok(`all ${TOTAL} generate requests 200 and well-formed, ${results.filter((r) => r.spec.stream).length} of them streamed`);

  // identical requests → identical text
  const groups = new Map();
  for (const r of results) {
    const k = keyOf(r.spec);
    if (!groups.has(k)) groups.set(k, []);
    groups.get(k).push(r);
  }
  let greedyGroups = 0, seededGroups = 0, bad = 0;
  for (const [k, rs] of groups) {
    const greedy = rs[0].spec.temperature === 0;
    const texts = new Set(rs.map((r) => r.text));
    if (texts.size !== 1) {
      bad++;
      fail(`${greedy ? 'greedy' : 'seeded'} requests ${k} gave ${texts.size} different texts: ` +
        rs.slice(0, 4).map((r) => `#${r.i} (${r.path}${r.spec.stream ? ', stream' : ''}) ${JSON.stringify(r.text)}`).join('; '));
    }
    if (greedy) greedyGroups++;
    else seededGroups++;
  }
  if (!bad) ok(`identical requests gave identical text (${greedyGroups} greedy groups incl. path f32 and streamed, ${seededGroups} seeded groups)`);
  const greedyRomeo = results.find((r) => r.spec.temperature === 0 && r.spec.prompt === 'ROMEO:');

  // --- bad requests ---
  const info = (await request('GET', '/api/info')).json || {};
  const maxPrompt = (info.limits && info.limits.max_prompt_chars) || 4096;
  const maxTokens = (info.limits && info.limits.max_tokens) || 2000;
  await expectError('bad JSON', 'POST', '/api/generate', '{"prompt": "ROMEO:", ', 400, {raw: true});
  await expectError('not an object', 'POST', '/api/generate', '["ROMEO:"]', 400, {raw: true});
  await expectError('unknown field', 'POST', '/api/generate', {prompt: 'ROMEO:', tokenz: 5}, 400, {mustMention: ['tokenz']});
  await expectError('no prompt', 'POST', '/api/generate', {tokens: 5}, 400, {mustMention: ['prompt']});
  await expectError('tokens 0', 'POST', '/api/generate', {prompt: 'ROMEO:', tokens: 0}, 400, {mustMention: ['tokens']});
  await expectError(`tokens ${maxTokens + 1}`, 'POST', '/api/generate', {prompt: 'ROMEO:', tokens: maxTokens + 1}, 400, {mustMention: ['tokens']});
  await expectError('temperature a string', 'POST', '/api/generate', {prompt: 'ROMEO:', temperature: 'hot'}, 400, {mustMention: ['temperature']});
  await expectError('path f64', 'POST', '/api/generate', {prompt: 'ROMEO:', path: 'f64'}, 400, {mustMention: ['path']});
  await expectError('prompt with ☃', 'POST', '/api/generate', {prompt: 'ROMEO: ☃', tokens: 4}, 400, {mustMention: ['☃', '2603']});
  await expectError(`prompt of ${maxPrompt + 1} characters`, 'POST', '/api/generate', {prompt: 'a'.repeat(maxPrompt + 1), tokens: 1}, 400, {mustMention: ['prompt']});
  await expectError('body over 4 MiB', 'POST', '/api/generate', JSON.stringify({prompt: 'a', pad: 'x'.repeat(4 * 1024 * 1024 + 16)}), 413, {raw: true});
  await expectError('train text too short', 'POST', '/api/train', {text: 'ROMEO:\n', steps: 1}, 400, {mustMention: ['text']});
  await expectError('train text with ☃', 'POST', '/api/train', {text: 'ROMEO: ☃\n'.repeat(60), steps: 1}, 400, {mustMention: ['☃', '2603']});
  await expectError('train steps 0', 'POST', '/api/train', {text: 'ROMEO: but soft\n'.repeat(40), steps: 0}, 400, {mustMention: ['steps']});
  await expectError('train unknown field', 'POST', '/api/train', {text: 'ROMEO: but soft\n'.repeat(40), stepz: 3}, 400, {mustMention: ['stepz']});
  const tr = (await request('GET', '/api/train')).json;
  if (tr && !tr.checkpoint && tr.state === 'idle') {
    await expectError('model finetuned before any fine-tune', 'POST', '/api/generate', {prompt: 'ROMEO:', tokens: 4, model: 'finetuned'}, 409);
    await expectError('checkpoint before any fine-tune', 'GET', '/api/checkpoint', undefined, 404);
  }
  await expectError('unknown endpoint', 'GET', '/api/nope', undefined, 404);

  // --- the event-subscriber limit: 32 streams, the 33rd is 503, all freed after ---
  await subscriberLimit(info);

  // --- still healthy ---
  const after = await request('GET', '/api/status');
  if (after.status !== 200 || !after.json || !after.json.ready) fail(`GET /api/status after the bad requests: ${after.status} ${after.text.slice(0, 200)}`);
  const again = await request('POST', '/api/generate', {prompt: 'ROMEO:', tokens: TOKENS, temperature: 0});
  if (again.status !== 200 || !again.json) fail(`generate after the bad requests: ${again.status} ${again.text.slice(0, 200)}`);
  else if (greedyRomeo && again.json.text !== greedyRomeo.text) fail(`greedy text after the bad requests changed: ${JSON.stringify(again.json.text)} vs ${JSON.stringify(greedyRomeo.text)}`);
  else ok(`server healthy after the bad requests (status ready, queue ${after.json && after.json.queue}; same greedy text)`);
}

try {
  await main();
} catch (e) {
  fail(`${e && e.stack ? e.stack : e}`);
}
console.log(`load test took ${secs()}`);
console.log(`load: ${passed} passed, ${failures.length} failed`);
process.exit(failures.length ? 1 : 0);
