// Browser test of the ptllm playground (web/ served by `ptllm serve`), in headless Chromium.
//
//   PTLLM_URL=http://127.0.0.1:PORT/ PTLLM_SCREENSHOT=/tmp/playground.png node browser.test.mjs
//
// Loads the page, waits for "ready to generate", checks the capability pills against
// GET /api/caps, generates greedily on path auto and on f32 (identical text), runs a short
// fine-tune (live loss chart, state done, checkpoint download with a safetensors header), and
// saves a full-page screenshot. No uncaught page errors and no console errors are allowed.
// Exits non-zero with a message on the first failure; every wait is bounded, 120 s in all.
import {chromium} from 'playwright-core';
import {existsSync, mkdtempSync, readFileSync, rmSync} from 'node:fs';
import {tmpdir} from 'node:os';
import {dirname, join} from 'node:path';
import {fileURLToPath} from 'node:url';

const BASE = (process.env.PTLLM_URL || '').replace(/\/?$/, '/');
const SHOT = process.env.PTLLM_SCREENSHOT || join(tmpdir(), 'playground.png');
const CHROMIUM = process.env.PTLLM_CHROMIUM || '/usr/bin/chromium';
const GLOBAL_TIMEOUT_MS = Number(process.env.PTLLM_BROWSER_TIMEOUT_MS || 120000);

if (!process.env.PTLLM_URL) {
  console.error('browser.test: set PTLLM_URL (e.g. http://127.0.0.1:8080/)');
  process.exit(2);
}

let passed = 0;
let context = null;
let userDataDir = null;
const t0 = Date.now();
const elapsed = () => ((Date.now() - t0) / 1000).toFixed(1) + 's';

function ok(msg) {
  passed++;
  console.log(`ok ${passed} - ${msg} [${elapsed()}]`);
}
class TestFailure extends Error {}
function check(cond, msg) {
  if (!cond) throw new TestFailure(msg);
}

async function cleanup() {
  try { if (context) await context.close(); } catch (_) { /* already gone */ }
  context = null;
  try { if (userDataDir) rmSync(userDataDir, {recursive: true, force: true}); } catch (_) { /* best effort */ }
}

const globalTimer = setTimeout(async () => {
  console.error(`FAIL: browser test exceeded its global timeout of ${GLOBAL_TIMEOUT_MS / 1000}s`);
  console.log(`browser: ${passed} passed, 1 failed`);
  await Promise.race([cleanup(), new Promise((r) => setTimeout(r, 3000))]);
  process.exit(1);
}, GLOBAL_TIMEOUT_MS);

async function api(path, init) {
  const res = await fetch(new URL(path.replace(/^\//, ''), BASE), {...init, signal: AbortSignal.timeout(30000)});
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch (_) { /* not JSON */ }
  return {status: res.status, json, text, headers: res.headers};
}

// Lines of text made only of characters the bundled tokenizer knows (tiny Shakespeare's).
function trainingText(chars) {
  const lines = [
    'ROMEO:',
    'But soft, what light through yonder window breaks?',
    'It is the east, and Juliet is the sun.',
    '',
    'JULIET:',
    'O Romeo, Romeo! wherefore art thou Romeo?',
    'Deny thy father and refuse thy name;',
    'Or, if thou wilt not, be but sworn my love,',
    "And I'll no longer be a Capulet.",
    '',
  ];
  let s = '';
  while (s.length < chars) s += lines.join('\n') + '\n';
  return s.slice(0, chars);
}

const pageErrors = [];
async function main() {
  const errors = pageErrors;

  // --- the server side of the truth ---
  const info = await api('/api/info');
  check(info.status === 200 && info.json && info.json.model, `GET /api/info → ${info.status} ${info.text.slice(0, 200)}`);
  ok(`GET /api/info: ${info.json.model.name} (${info.json.model.n_layer} layers, vocab ${info.json.model.vocab_size}), backend ${info.json.backend}`);

  // the page's three files, with types a browser will use (nosniff makes them strict)
  const want = {'/': /^text\/html\b/, '/app.js': /^(text|application)\/javascript\b/, '/style.css': /^text\/css\b/};
  for (const [path, re] of Object.entries(want)) {
    const r = await api(path);
    const type = r.headers.get('content-type') || '';
    check(r.status === 200 && r.text.length > 0, `GET ${path} → ${r.status}`);
    check(re.test(type), `GET ${path}: Content-Type ${JSON.stringify(type)}, want ${re}`);
  }
  ok('GET /, /app.js, /style.css: 200 with text/html, javascript and text/css types');
  // a binary built before the last edit of web/ serves an older page: say so (not a failure)
  const stale = [];
  for (const [path, file] of [['/', 'index.html'], ['/app.js', 'app.js'], ['/style.css', 'style.css']]) {
    const local = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'web', file);
    if (existsSync(local) && readFileSync(local, 'utf8') !== (await api(path)).text) stale.push(file);
  }
  if (stale.length) console.log(`note: the server's embedded ${stale.join(', ')} differ from web/ here (rebuild the binary to test the current page)`);

  // --- browser ---
  userDataDir = mkdtempSync(join(tmpdir(), 'ptllm-chromium-'));
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: {width: 1400, height: 900},
    timeout: 30000,
  });
  context.setDefaultTimeout(30000);
  const page = context.pages()[0] || await context.newPage();
  page.on('pageerror', (e) => errors.push(`page error: ${e.message}`));
  page.on('console', (m) => {
    if (m.type() === 'error') errors.push(`console error: ${m.text()} (${(m.location() || {}).url || ''})`);
  });
  page.on('requestfailed', (r) => {
    // an aborted generate (the Stop button) is expected to fail
    const f = r.failure();
    if (!(f && /ERR_ABORTED/.test(f.errorText))) errors.push(`request failed: ${r.url()} ${f ? f.errorText : ''}`);
  });
  // the page may reference only itself
  const foreign = [];
  page.on('request', (r) => {
    const u = r.url();
    if (!u.startsWith(BASE) && !u.startsWith('data:')) foreign.push(u);
  });

  const resp = await page.goto(BASE, {waitUntil: 'load', timeout: 30000});
  check(resp && resp.status() === 200, `GET / → ${resp ? resp.status() : 'no response'}`);
  await page.waitForFunction(() => document.documentElement.dataset.app === 'loaded', null, {timeout: 10000})
    .catch(() => { throw new TestFailure('app.js did not run (no data-app="loaded" on <html> within 10s)'); });
  ok('the page loads and app.js runs');

  // --- status bar ---
  await page.waitForFunction(() => /ready to generate/.test(document.querySelector('#status').textContent),
    null, {timeout: 60000}).catch(async () => {
    throw new TestFailure(`#status never said "ready to generate" within 60s; it says: ${await page.textContent('#status')}`);
  });
  const status = (await api('/api/status')).json;
  check(status && status.ready === true, `GET /api/status not ready: ${JSON.stringify(status)}`);
  await page.waitForFunction((line) => document.querySelector('#status').textContent === line, status.line, {timeout: 10000})
    .catch(async () => {
      throw new TestFailure(`#status is "${await page.textContent('#status')}", GET /api/status line is "${status.line}"`);
    });
  ok(`status bar: "${status.line}"`);

  // --- capability pills vs GET /api/caps ---
  const caps = (await api('/api/caps')).json;
  check(caps && Array.isArray(caps.pills) && Array.isArray(caps.paths), `GET /api/caps malformed: ${JSON.stringify(caps).slice(0, 300)}`);
  await page.waitForFunction((want) => {
    const got = [...document.querySelectorAll('#pills .pill.on')].map((e) => e.textContent);
    return JSON.stringify(got) === JSON.stringify(want);
  }, caps.pills, {timeout: 10000}).catch(async () => {
    const got = await page.$$eval('#pills .pill.on', (es) => es.map((e) => e.textContent));
    throw new TestFailure(`active pills ${JSON.stringify(got)} != GET /api/caps pills ${JSON.stringify(caps.pills)}`);
  });
  const f16 = caps.paths.find((p) => p.path === 'f16-storage');
  const f16Active = !!(f16 && f16.active);
  const f16Shown = (await page.$$eval('#pills .pill.on', (es) => es.map((e) => e.textContent))).includes('+f16 storage');
  check(f16Shown === f16Active, `+f16 storage pill shown=${f16Shown} but caps says f16-storage active=${f16Active}`);
  ok(`pills ${JSON.stringify(caps.pills)} match /api/caps (f16-storage ${f16Active ? 'active, pill shown' : 'inactive, no pill'})`);

  const rejected = caps.paths.filter((p) => p.supported && p.ran && !p.pass && !p.active);
  const offPills = await page.$$eval('#pills .pill.off', (es) => es.map((e) => ({text: e.textContent, title: e.title, path: e.dataset.path})));
  check(offPills.length === rejected.length,
    `switched-off pills ${JSON.stringify(offPills.map((p) => p.path))} != rejected paths ${JSON.stringify(rejected.map((p) => p.path))}`);
  for (const p of offPills) {
    check(/max_abs=/.test(p.title) && /mean_rel=/.test(p.title) && /verdict/.test(p.title),
      `switched-off pill ${p.path} has no gate numbers in its title: "${p.title}"`);
  }
  const detailsText = await page.textContent('#details');
  for (const p of caps.paths) {
    check(detailsText.includes(p.path), `#details does not list path ${p.path}`);
    if (!p.supported) check(/not supported \(/.test(detailsText), `#details does not say "not supported (reason)" for ${p.path}`);
  }
  for (const p of rejected) {
    const row = await page.textContent(`#details [data-path="${p.path}"]`);
    check(/max_abs/.test(row) && /mean_rel/.test(row) && /FAIL/.test(row), `#details row of rejected ${p.path} lacks its gate numbers: ${row}`);
  }
  ok(`${offPills.length} switched-off pill(s) with gate numbers; #details lists all ${caps.paths.length} path(s)` +
    ` (${caps.paths.filter((p) => !p.supported).length} not supported)`);

  // --- gate report ---
  const gates = (await api('/api/gates')).json;
  check(gates && Array.isArray(gates.lines) && gates.lines.length > 0, `GET /api/gates has no lines: ${JSON.stringify(gates)}`);
  const shown = await page.$$eval('#gate-lines > *', (es) => es.map((e) => e.textContent));
  for (let i = 0; i < gates.lines.length; i++) {
    check(shown[i] === gates.lines[i], `gate line ${i} in #gate-lines is ${JSON.stringify(shown[i])}, /api/gates has ${JSON.stringify(gates.lines[i])}`);
  }
  ok(`gate report shows all ${gates.lines.length} gate lines of /api/gates, in order`);

  // --- generate: greedy on auto, then on f32 ---
  async function generate({prompt = 'ROMEO:', temperature = '0', tokens = '120', seed = '42', path = 'auto', model = 'base'} = {}) {
    await page.fill('#prompt', prompt);
    await page.fill('#temperature', temperature);
    await page.fill('#top-k', '0');
    await page.fill('#top-p', '1');
    await page.fill('#tokens', tokens);
    await page.fill('#seed', seed);
    await page.selectOption('#path', path);
    await page.selectOption('#model', model);
    await page.click('#generate');
    await page.waitForFunction(() => ['done', 'error'].includes(document.querySelector('#output').dataset.state) &&
      !document.querySelector('#generate').disabled, null, {timeout: 60000}).catch(async () => {
      throw new TestFailure(`generation (path ${path}) did not finish in 60s: #output state ${await page.getAttribute('#output', 'data-state')}`);
    });
    const st = await page.getAttribute('#output', 'data-state');
    if (st !== 'done') throw new TestFailure(`generation (path ${path}) ended in state ${st}: ${await page.textContent('#error')}`);
    const out = await page.textContent('#output');
    check(out.startsWith(prompt), `#output does not start with the prompt: ${JSON.stringify(out.slice(0, 60))}`);
    return {text: out.slice(prompt.length), info: await page.textContent('#gen-info')};
  }

  const autoPath = caps.forward_path || status.forward_path || 'f32';
  const a = await generate({path: 'auto'});
  check(a.text.length > 0, 'greedy output on path auto is empty');
  check(a.info.includes(`path ${autoPath}`), `#gen-info after auto does not name path ${autoPath}: "${a.info}"`);
  check(/\b120 tokens\b/.test(a.info) && /tok\/s/.test(a.info), `#gen-info lacks tokens and tok/s: "${a.info}"`);
  ok(`auto: 120 greedy tokens streamed; #gen-info "${a.info}"`);

  const b = await generate({path: 'f32'});
  check(b.info.includes('path f32'), `#gen-info after f32 does not name path f32: "${b.info}"`);
  check(a.text === b.text, `greedy output differs between auto (${autoPath}) and f32:\n  auto: ${JSON.stringify(a.text)}\n  f32:  ${JSON.stringify(b.text)}`);
  ok(`f32: identical greedy text to auto (${a.text.length} chars); #gen-info "${b.info}"`);

  const ns = await api('/api/generate', {method: 'POST', headers: {'Content-Type': 'application/json'},
    body: JSON.stringify({prompt: 'ROMEO:', tokens: 120, temperature: 0, seed: 42, path: 'auto', stream: false})});
  check(ns.status === 200 && ns.json && ns.json.text === a.text,
    `non-streaming POST /api/generate (${ns.status}) text differs from what the page streamed:\n  page: ${JSON.stringify(a.text)}\n  api:  ${JSON.stringify(ns.json && ns.json.text)}`);
  ok('the streamed text equals the non-streaming API response');

  // Stop aborts a long generation
  await page.fill('#temperature', '0.8');
  await page.fill('#tokens', '2000');
  await page.selectOption('#path', 'auto');
  await page.click('#generate');
  await page.waitForFunction(() => document.querySelector('#output .gen') &&
    document.querySelector('#output .gen').textContent.length >= 5, null, {timeout: 30000});
  await page.click('#stop');
  await page.waitForFunction(() => document.querySelector('#output').dataset.state === 'idle' &&
    !document.querySelector('#generate').disabled, null, {timeout: 10000}).catch(async () => {
    throw new TestFailure(`Stop did not end the generation: #output state ${await page.getAttribute('#output', 'data-state')}`);
  });
  ok(`Stop aborts a generation: "${await page.textContent('#gen-info')}"`);

  // --- fine-tune ---
  const before = (await api('/api/train')).json;
  if (before && !before.checkpoint) {
    check((await page.getAttribute('#ft-download', 'aria-disabled')) === 'true', 'download link enabled before any fine-tune');
    check(await page.$eval('#model option[value="finetuned"]', (o) => o.disabled), 'model option fine-tuned enabled before any fine-tune');
  }
  await page.click('#tab-finetune');
  await page.evaluate(() => {
    window.__points = [];
    window.__states = [];
    const c = document.querySelector('#loss-chart');
    new MutationObserver(() => window.__points.push(Number(c.dataset.points))).observe(c, {attributes: true, attributeFilter: ['data-points']});
    const p = document.querySelector('#ft-progress');
    new MutationObserver(() => window.__states.push(p.dataset.state)).observe(p, {attributes: true, attributeFilter: ['data-state']});
  });
  const text = trainingText(3000);
  await page.fill('#ft-text', text);
  await page.fill('#ft-steps', '6');
  await page.fill('#ft-batch', '2');
  await page.click('#ft-start');
  // (a previous job's final state may still be shown: wait for this job to have run)
  await page.waitForFunction(() => window.__states.includes('running') &&
    ['done', 'stopped', 'failed'].includes(document.querySelector('#ft-progress').dataset.state), null, {timeout: 90000}).catch(async () => {
    throw new TestFailure(`fine-tune did not end in 90s: #ft-progress "${await page.textContent('#ft-progress')}"`);
  });
  const ftState = await page.getAttribute('#ft-progress', 'data-state');
  const progress = await page.textContent('#ft-progress');
  check(ftState === 'done', `fine-tune ended in state ${ftState}: "${progress}" ${await page.textContent('#error')}`);
  check(/step 6\/6/.test(progress) && /train loss \d/.test(progress), `#ft-progress after done: "${progress}"`);
  const points = await page.evaluate(() => window.__points);
  const finalPoints = Number(await page.getAttribute('#loss-chart', 'data-points'));
  check(finalPoints === 6, `#loss-chart data-points is ${finalPoints} after 6 steps`);
  check(new Set(points.filter((p) => p > 0)).size >= 2 && points.every((p, i) => i === 0 || p >= points[i - 1] || p === 0),
    `#loss-chart data-points did not grow step by step: ${JSON.stringify(points)}`);
  ok(`fine-tune done: "${progress}"; chart points ${JSON.stringify([...new Set(points)])}`);

  await page.waitForFunction(() => document.querySelector('#ft-download').getAttribute('aria-disabled') === 'false',
    null, {timeout: 10000}).catch(() => { throw new TestFailure('the download link is not enabled after the fine-tune'); });
  const ck = await page.evaluate(async () => {
    const href = document.querySelector('#ft-download').href;
    const res = await fetch(href);
    const buf = new Uint8Array(await res.arrayBuffer());
    const n = Number(new DataView(buf.buffer).getBigUint64(0, true));
    return {href, status: res.status, type: res.headers.get('content-type'), disposition: res.headers.get('content-disposition'),
      size: buf.length, n, first: buf.length > 8 ? String.fromCharCode(buf[8]) : '',
      header: new TextDecoder().decode(buf.slice(8, 8 + Math.min(n, 1 << 20)))};
  });
  check(ck.status === 200, `GET ${ck.href} → ${ck.status}`);
  check(ck.size > 16 && ck.n > 0 && 8 + ck.n <= ck.size && ck.first === '{',
    `checkpoint is not safetensors: ${ck.size} bytes, header length ${ck.n}, byte 8 ${JSON.stringify(ck.first)}`);
  let header;
  try { header = JSON.parse(ck.header); } catch (e) { throw new TestFailure(`checkpoint header is not JSON: ${e.message}`); }
  check(header.__metadata__ && Object.keys(header).length >= 2, 'checkpoint header lacks __metadata__ or tensors');
  ok(`checkpoint download: ${ck.size} bytes, ${ck.n}-byte JSON header, ${Object.keys(header).length - 1} tensors, ${ck.type}; ${ck.disposition}`);

  // the fine-tune view with its chart is the screenshot named PTLLM_SCREENSHOT
  await page.waitForTimeout(150);
  await page.screenshot({path: SHOT, fullPage: true});
  ok(`screenshot saved: ${SHOT}`);

  // Stop ends a running fine-tune after its current step
  await page.fill('#ft-steps', '500');
  await page.evaluate(() => { window.__states = []; });
  await page.click('#ft-start');
  await page.waitForFunction(() => window.__states.includes('running') && Number(document.querySelector('#loss-chart').dataset.points) >= 1,
    null, {timeout: 30000}).catch(async () => {
    throw new TestFailure(`the 500-step fine-tune made no step in 30s: "${await page.textContent('#ft-progress')}"`);
  });
  check(!(await page.$eval('#ft-stop', (b) => b.disabled)), '#ft-stop is disabled while a fine-tune runs');
  check(await page.$eval('#ft-start', (b) => b.disabled), '#ft-start is enabled while a fine-tune runs');
  await page.click('#ft-stop');
  await page.waitForFunction(() => ['stopped', 'done', 'failed'].includes(document.querySelector('#ft-progress').dataset.state),
    null, {timeout: 30000}).catch(async () => {
    throw new TestFailure(`Stop did not end the fine-tune in 30s: "${await page.textContent('#ft-progress')}"`);
  });
  const stopped = await page.textContent('#ft-progress');
  check((await page.getAttribute('#ft-progress', 'data-state')) === 'stopped', `after Stop the fine-tune is not stopped: "${stopped}"`);
  const stSteps = Number(await page.getAttribute('#loss-chart', 'data-points'));
  check(stSteps >= 1 && stSteps < 500, `stopped fine-tune drew ${stSteps} points`);
  await page.waitForFunction(() => document.querySelector('#ft-download').getAttribute('aria-disabled') === 'false', null, {timeout: 10000})
    .catch(() => { throw new TestFailure('no checkpoint download after a stopped fine-tune'); });
  ok(`Stop ends a fine-tune: "${stopped}"`);

  // the fine-tuned model is selectable and generates
  await page.click('#tab-generate');
  check(!(await page.$eval('#model option[value="finetuned"]', (o) => o.disabled)), 'model option fine-tuned still disabled after the fine-tune');
  const c = await generate({path: 'auto', model: 'finetuned', tokens: '40'});
  check(c.text.length > 0 && c.info.includes('model finetuned'), `fine-tuned generation: "${c.info}"`);
  ok(`generation with the fine-tuned model: "${c.info}"`);
  await page.screenshot({path: SHOT.replace(/\.png$/, '') + '-generate.png', fullPage: true});

  // --- no errors anywhere ---
  check(await page.$eval('#error', (e) => e.hidden), `#error is shown: ${await page.textContent('#error')}`);
  check(foreign.length === 0, `the page requested other hosts: ${foreign.join(', ')}`);
  check(errors.length === 0, `page/console errors:\n  ${errors.join('\n  ')}`);
  ok('no page errors, no console errors, no foreign requests, no error banner');
}

let failed = 0;
try {
  await main();
} catch (e) {
  failed = 1;
  console.error(`FAIL: ${e instanceof TestFailure ? e.message : (e && e.stack) || e}`);
  if (pageErrors.length) console.error(`page/console errors so far:\n  ${pageErrors.join('\n  ')}`);
  if (context) {
    try {
      const p = context.pages()[0];
      if (p) {
        const f = SHOT.replace(/\.png$/, '') + '-failure.png';
        await p.screenshot({path: f, fullPage: true, timeout: 5000});
        console.error(`failure screenshot: ${f}`);
      }
    } catch (_) { /* best effort */ }
  }
}
await cleanup();
clearTimeout(globalTimer);
console.log(`browser test took ${elapsed()}`);
console.log(`browser: ${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
