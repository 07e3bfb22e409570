// ptllm playground: the page served by `ptllm serve` (docs/playground.md is the API contract).
// Plain JS, no dependencies. Server text only ever goes into the DOM through textContent /
// createTextNode / attributes, never through innerHTML.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);

  // ---------- small helpers ----------

  // Build an element: el('div', {class: 'x', title: 't'}, child, 'text', ...).
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v === undefined || v === null || v === false) continue;
        if (k === 'class') e.className = v;
        else if (k === 'text') e.textContent = v;
        else e.setAttribute(k, v === true ? '' : String(v));
      }
    }
    for (const c of children) {
      if (c === undefined || c === null || c === false) continue;
      e.appendChild(typeof c === 'string' || typeof c === 'number' ? document.createTextNode(String(c)) : c);
    }
    return e;
  }

  const isNum = (x) => typeof x === 'number' && Number.isFinite(x);

  // 1.22e-01 like fmt's {:.2e}
  function fmtE(x, digits = 2) {
    if (!isNum(x)) return '—';
    const s = x.toExponential(digits);
    return s.replace(/e([+-])(\d)$/, 'e$10$2');
  }
  function fmtPct(x, digits = 3) {
    return isNum(x) ? (x * 100).toFixed(digits) + '%' : '—';
  }
  function fmtLoss(x) {
    return isNum(x) ? x.toFixed(4) : '—';
  }
  function fmtRate(x) {
    if (!isNum(x)) return '—';
    return x >= 100 ? Math.round(x).toLocaleString('en-US') : x.toFixed(1);
  }
  function fmtDuration(s) {
    if (!isNum(s) || s < 0) return '—';
    if (s < 60) return s.toFixed(1) + 's';
    const m = Math.floor(s / 60);
    const r = Math.round(s - m * 60);
    return m + 'm ' + String(r).padStart(2, '0') + 's';
  }
  function fmtBytes(n) {
    if (n < 1024) return n + ' B';
    if (n < 1024 * 1024) return (n / 1024).toFixed(1) + ' KiB';
    return (n / 1024 / 1024).toFixed(2) + ' MiB';
  }

  // ---------- error banner ----------

  function showError(msg) {
    $('error-text').textContent = String(msg);
    $('error').hidden = false;
  }
  function clearError() {
    $('error-text').textContent = '';
    $('error').hidden = true;
  }
  $('error-close').addEventListener('click', clearError);

  // Parse a server error body ({"error": "..."}) into one line.
  async function errorText(res) {
    let body = '';
    try {
      body = await res.text();
      const j = JSON.parse(body);
      if (j && typeof j.error === 'string') return `${res.status}: ${j.error}`;
    } catch (_) { /* not JSON */ }
    return `${res.status} ${res.statusText}${body ? ': ' + body.slice(0, 200) : ''}`;
  }

  async function getJson(url) {
    const res = await fetch(url, {headers: {Accept: 'application/json'}, cache: 'no-store'});
    if (!res.ok) throw new Error(`GET ${url} → ${await errorText(res)}`);
    return res.json();
  }

  async function postJson(url, body) {
    const res = await fetch(url, {
      method: 'POST',
      headers: {'Content-Type': 'application/json', Accept: 'application/json'},
      body: JSON.stringify(body === undefined ? {} : body),
    });
    if (!res.ok) throw new Error(`POST ${url} → ${await errorText(res)}`);
    return res.json();
  }

  // ---------- state ----------

  const state = {
    status: null,
    caps: null,
    gates: [],
    train: null,
    info: null,
    gotHello: false,
    generating: null, // AbortController while a generation streams
  };

  // ---------- status bar ----------

  function renderStatus() {
    const s = state.status;
    const line = $('status');
    if (!s) {
      line.textContent = 'warming up…';
      line.dataset.ready = 'false';
      $('status-meta').textContent = '';
      return;
    }
    line.textContent = typeof s.line === 'string' && s.line ? s.line : (s.ready ? 'ready' : 'warming up…');
    line.dataset.ready = s.ready ? 'true' : 'false';
    const meta = [];
    if (s.forward_path) meta.push('forward ' + s.forward_path);
    if (isNum(s.queue)) meta.push('queue ' + s.queue);
    if (s.training) meta.push('training');
    $('status-meta').textContent = meta.join(' · ');
    if (typeof s.error === 'string' && s.error && s.error !== state.lastStatusError) {
      state.lastStatusError = s.error;
      showError(`server: ${s.error}`);
    }
  }

  // ---------- caps: pills + details ----------

  function metricSummary(p) {
    const m = p.metric || {};
    const parts = [
      `mean|ref|=${fmtE(m.mean_abs_ref)}`,
      `max_abs=${fmtE(m.max_abs)} (limit ${fmtE(m.max_abs_limit)})`,
      `mean_rel=${fmtPct(m.mean_rel)} (limit ${fmtPct(m.mean_rel_limit)})`,
      `max_rel=${fmtPct(m.max_rel, 2)}`,
      `verdict ${p.verdict || (p.pass ? 'PASS' : 'FAIL')}`,
    ];
    if (m.reason) parts.push(`(${m.reason})`);
    return parts.join(' · ');
  }

  function pathKind(p) {
    if (p.active) return 'active';
    if (!p.supported) return 'unsupported';
    if (p.selected === false) return 'unselected';
    if (p.ran && !p.pass) return 'rejected';
    if (p.ran && p.pass) return 'passed'; // passed but not used (e.g. demoted, or not the forward path)
    return 'pending';
  }

  function unsupportedReason(p) {
    if (p.unsupported_reason) return p.unsupported_reason;
    if (p.metric && p.metric.reason) return p.metric.reason;
    if (Array.isArray(p.missing) && p.missing.length) return 'missing ' + p.missing.join(', ');
    return 'not detected';
  }

  function renderPills() {
    const box = $('pills');
    box.replaceChildren();
    const caps = state.caps;
    if (!caps) {
      box.appendChild(el('span', {class: 'pill-none', text: 'gates running…'}));
      return;
    }
    const paths = Array.isArray(caps.paths) ? caps.paths : [];
    const active = Array.isArray(caps.pills) ? caps.pills : paths.filter((p) => p.active).map((p) => p.pill);
    for (const text of active) {
      const p = paths.find((q) => q.pill === text);
      box.appendChild(el('span', {
        class: 'pill on',
        'data-path': p ? p.path : null,
        title: p ? `${p.path}: gate PASS — active\n${metricSummary(p)}` : 'active',
        text,
      }));
    }
    for (const p of paths) {
      if (pathKind(p) !== 'rejected') continue;
      const pill = el('span', {
        class: 'pill off',
        'data-path': p.path,
        title: `${p.path}: detected but rejected by its gate — off\n${metricSummary(p)}`,
        text: p.pill || p.path,
      });
      pill.addEventListener('click', () => focusDetails(p.path));
      box.appendChild(pill);
    }
    if (!box.children.length) box.appendChild(el('span', {class: 'pill-none', text: 'f32 only'}));
  }

  function focusDetails(path) {
    const row = document.querySelector(`#details [data-path="${CSS.escape(path)}"]`);
    if (!row) return;
    row.scrollIntoView({block: 'nearest'});
    row.classList.remove('flash');
    void row.offsetWidth;
    row.classList.add('flash');
  }

  function kv(k, v, cls) {
    return el('div', {class: 'kv' + (cls ? ' ' + cls : '')}, el('span', {class: 'k', text: k}), el('span', {class: 'v', text: v}));
  }

  function renderDetails() {
    const box = $('details');
    box.replaceChildren();
    const caps = state.caps;
    if (!caps) {
      box.appendChild(el('div', {class: 'muted', text: 'waiting for the gates…'}));
      return;
    }
    const paths = Array.isArray(caps.paths) ? caps.paths : [];
    const kindLabel = {
      active: 'active',
      rejected: 'rejected (gate FAIL) — off',
      unsupported: 'not supported',
      unselected: 'not selected (--paths)',
      passed: 'passed — not in use',
      pending: 'gate pending',
    };
    for (const p of paths) {
      const kind = pathKind(p);
      const row = el('div', {class: 'path-row ' + kind, 'data-path': p.path, 'data-kind': kind});
      const head = el('div', {class: 'path-head'},
        el('span', {class: 'path-name mono', text: p.path}),
        p.pill ? el('span', {class: 'pill mini ' + (kind === 'active' ? 'on' : kind === 'rejected' ? 'off' : 'na'), text: p.pill}) : null,
        el('span', {class: 'path-kind', text: kind === 'unsupported' ? `not supported (${unsupportedReason(p)})` : kindLabel[kind]}));
      row.appendChild(head);
      if (p.ran && p.metric) {
        const m = p.metric;
        const grid = el('div', {class: 'metric mono'});
        grid.appendChild(kv('mean|ref|', fmtE(m.mean_abs_ref)));
        grid.appendChild(kv('max_abs', `${fmtE(m.max_abs)}  (limit ${fmtE(m.max_abs_limit)})`,
          isNum(m.max_abs) && isNum(m.max_abs_limit) && !(m.max_abs < m.max_abs_limit) ? 'bad' : ''));
        grid.appendChild(kv('mean_rel', `${fmtPct(m.mean_rel)}  (limit ${fmtPct(m.mean_rel_limit)})`,
          isNum(m.mean_rel) && isNum(m.mean_rel_limit) && !(m.mean_rel < m.mean_rel_limit) ? 'bad' : ''));
        grid.appendChild(kv('max_rel', fmtPct(m.max_rel, 2) + '  (informational)'));
        const extra = [];
        if (p.cached) extra.push('cached');
        if (isNum(p.millis)) extra.push(p.millis.toFixed(1) + ' ms');
        grid.appendChild(kv('verdict', (p.verdict || (p.pass ? 'PASS' : 'FAIL')) + (extra.length ? `  (${extra.join(', ')})` : ''),
          p.pass ? 'good' : 'bad'));
        if (m.reason) grid.appendChild(kv('reason', m.reason, 'bad'));
        row.appendChild(grid);
      }
      if (p.device) row.appendChild(el('div', {class: 'path-sub muted', text: `device ${p.device}` +
        (Array.isArray(p.requires) && p.requires.length ? ` · requires ${p.requires.join(', ')}` : '')}));
      box.appendChild(row);
    }
    if (!paths.length) box.appendChild(el('div', {class: 'muted', text: 'no accelerated paths registered'}));

    // model-level gates
    const mg = caps.model_gates;
    const mgBox = el('div', {class: 'sub-box'});
    mgBox.appendChild(el('div', {class: 'sub-title', text: 'model-level gates'}));
    if (mg && typeof mg === 'object') {
      mgBox.appendChild(kv('path', String(mg.path ?? '—')));
      mgBox.appendChild(kv('inference', mg.inference_ok ? 'ok' : 'failed', mg.inference_ok ? 'good' : 'bad'));
      mgBox.appendChild(kv('training', mg.training_ok ? 'ok' : 'failed', mg.training_ok ? 'good' : 'bad'));
    } else {
      mgBox.appendChild(el('div', {class: 'muted', text: 'not settled yet'}));
    }
    box.appendChild(mgBox);

    // machine
    const c = caps.capabilities || {};
    const mBox = el('div', {class: 'sub-box'});
    mBox.appendChild(el('div', {class: 'sub-title', text: 'machine'}));
    mBox.appendChild(kv('backend', String(caps.backend ?? '—')));
    mBox.appendChild(kv('paths', String(caps.paths_selection ?? '—')));
    mBox.appendChild(kv('forward', String(caps.forward_path ?? '—')));
    if (c.cpu_model) mBox.appendChild(kv('cpu', String(c.cpu_model)));
    if (c.hwy_dispatched) mBox.appendChild(kv('simd', String(c.hwy_dispatched) +
      (Array.isArray(c.hwy_targets) && c.hwy_targets.length ? ` (of ${c.hwy_targets.join(' ')})` : '')));
    if (c.gpu !== undefined && c.gpu !== null) {
      const g = c.gpu;
      let gtext;
      if (typeof g === 'string') gtext = g;
      else if (typeof g === 'object') gtext = g.name || g.reason || g.error || (g.available === false ? 'none' : JSON.stringify(g));
      else gtext = String(g);
      mBox.appendChild(kv('gpu', String(gtext)));
    }
    if (c.flags && typeof c.flags === 'object') {
      const on = Object.entries(c.flags).filter(([, v]) => v).map(([k]) => k);
      const off = Object.entries(c.flags).filter(([, v]) => !v).map(([k]) => k);
      mBox.appendChild(kv('flags', on.join(' ') || '—'));
      if (off.length) mBox.appendChild(kv('missing', off.join(' '), 'muted'));
    }
    box.appendChild(mBox);
  }

  function renderCaps() {
    renderPills();
    renderDetails();
  }

  // ---------- gate report ----------

  function gateLineNode(line) {
    const s = String(line);
    let cls = 'gl';
    if (/\bFAIL\b|demot/i.test(s)) cls += ' fail';
    else if (/\bPASS\b/.test(s)) cls += ' pass';
    return el('div', {class: cls, text: s});
  }

  function renderGates() {
    const box = $('gate-lines');
    box.replaceChildren(...state.gates.map(gateLineNode));
    $('gate-count').textContent = state.gates.length ? `(${state.gates.length} lines)` : '';
    box.scrollTop = box.scrollHeight;
  }

  function appendGate(line) {
    state.gates.push(String(line));
    const box = $('gate-lines');
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    box.appendChild(gateLineNode(line));
    $('gate-count').textContent = `(${state.gates.length} lines)`;
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  // ---------- model info ----------

  function renderInfo() {
    const i = state.info;
    if (!i || !i.model) return;
    const m = i.model;
    const params = isNum(m.params) ? (m.params >= 1e6 ? (m.params / 1e6).toFixed(2) + 'M' : (m.params / 1e3).toFixed(0) + 'k') : '?';
    const parts = [
      String(m.name ?? 'model'),
      `${m.n_layer}L ${m.n_head}H ${m.n_embd}d`,
      `ctx ${m.block_size}`,
      `vocab ${m.vocab_size}`,
      `${params} params`,
      String(i.backend ?? ''),
    ].filter(Boolean);
    $('model-info').textContent = parts.join(' · ');
    $('model-info').title = [i.device, i.version ? 'ptllm ' + i.version : ''].filter(Boolean).join(' · ');
    const l = i.limits || {};
    if (isNum(l.max_tokens)) $('tokens').max = String(l.max_tokens);
    if (isNum(l.max_prompt_chars)) $('prompt').maxLength = l.max_prompt_chars;
    if (isNum(l.max_train_steps)) $('ft-steps').max = String(l.max_train_steps);
    if (isNum(l.max_batch_size)) $('ft-batch').max = String(l.max_batch_size);
  }

  // ---------- tabs ----------

  function selectTab(name) {
    for (const t of ['generate', 'finetune']) {
      const on = t === name;
      $('tab-' + t).setAttribute('aria-selected', on ? 'true' : 'false');
      $('panel-' + t).hidden = !on;
    }
    if (name === 'finetune') drawChart();
  }
  $('tab-generate').addEventListener('click', () => selectTab('generate'));
  $('tab-finetune').addEventListener('click', () => selectTab('finetune'));

  // ---------- SSE parsing for the fetch body ----------

  // Incremental text/event-stream parser (the WHATWG rules that matter here).
  class SseParser {
    constructor(onEvent) {
      this.buf = '';
      this.type = '';
      this.data = [];
      this.onEvent = onEvent;
    }
    feed(text) {
      this.buf += text;
      for (;;) {
        const m = /\r\n|\r|\n/.exec(this.buf);
        if (!m) break;
        // a lone \r at the very end may be the first half of \r\n: wait for more
        if (m[0] === '\r' && m.index === this.buf.length - 1) break;
        const line = this.buf.slice(0, m.index);
        this.buf = this.buf.slice(m.index + m[0].length);
        this.line(line);
      }
    }
    line(line) {
      if (line === '') {
        if (this.data.length) this.onEvent(this.type || 'message', this.data.join('\n'));
        this.type = '';
        this.data = [];
        return;
      }
      if (line[0] === ':') return; // comment / keep-alive
      const i = line.indexOf(':');
      const field = i < 0 ? line : line.slice(0, i);
      let value = i < 0 ? '' : line.slice(i + 1);
      if (value[0] === ' ') value = value.slice(1);
      if (field === 'event') this.type = value;
      else if (field === 'data') this.data.push(value);
    }
    end() {
      if (this.buf) this.line(this.buf);
      this.buf = '';
      this.line('');
    }
  }

  // ---------- generate ----------

  function intOrNull(id) {
    const v = $(id).value.trim();
    if (v === '') return null;
    const n = Number(v);
    return Number.isFinite(n) ? n : NaN;
  }

  function setGenState(s) {
    $('output').dataset.state = s;
    const running = s === 'running';
    $('generate').disabled = running;
    $('stop').disabled = !running;
  }

  function genBody() {
    const body = {prompt: $('prompt').value, stream: true, path: $('path').value, model: $('model').value};
    const fields = [['temperature', 'temperature'], ['top-k', 'top_k'], ['top-p', 'top_p'], ['tokens', 'tokens'], ['seed', 'seed'], ['speculative', 'speculative']];
    for (const [id, key] of fields) {
      const v = intOrNull(id);
      if (v === null) continue;
      if (Number.isNaN(v)) throw new Error(`${key}: not a number`);
      body[key] = v;
    }
    return body;
  }

  async function generate() {
    if (state.generating) return;
    clearError();
    let body;
    try {
      body = genBody();
    } catch (e) {
      showError(e.message);
      return;
    }
    const out = $('output');
    out.replaceChildren();
    const promptSpan = el('span', {class: 'echo', text: body.prompt});
    const textNode = document.createTextNode('');
    const genSpan = el('span', {class: 'gen'}, textNode);
    out.append(promptSpan, genSpan);
    $('gen-info').textContent = 'waiting…';
    $('gen-info').dataset.path = '';
    setGenState('running');

    const ctrl = new AbortController();
    state.generating = ctrl;
    let count = 0;
    let started = null;
    let finished = false;
    const t0 = performance.now();

    const fail = (msg) => {
      finished = true;
      setGenState('error');
      $('gen-info').textContent = 'error';
      showError(msg);
    };

    try {
      const res = await fetch('/api/generate', {
        method: 'POST',
        headers: {'Content-Type': 'application/json', Accept: 'text/event-stream'},
        body: JSON.stringify(body),
        signal: ctrl.signal,
      });
      if (!res.ok) {
        fail(`generate → ${await errorText(res)}`);
        return;
      }
      const parser = new SseParser((type, data) => {
        if (finished) return;
        let j;
        try {
          j = JSON.parse(data);
        } catch (_) {
          fail(`generate: malformed ${type} event: ${data.slice(0, 120)}`);
          return;
        }
        if (type === 'start') {
          started = j;
          $('gen-info').textContent = `generating · path ${j.path ?? '?'} · model ${j.model ?? '?'}` +
            (isNum(j.queued_ms) ? ` · queued ${j.queued_ms.toFixed(1)} ms` : '');
          $('gen-info').dataset.path = String(j.path ?? '');
        } else if (type === 'token') {
          textNode.appendData(String(j.text ?? ''));
          count++;
          if (count % 8 === 0) out.scrollTop = out.scrollHeight;
        } else if (type === 'done') {
          finished = true;
          // the done object carries the authoritative text
          if (typeof j.text === 'string' && j.text !== textNode.data) textNode.data = j.text;
          const parts = [
            `path ${j.path ?? (started && started.path) ?? '?'}`,
            `model ${j.model ?? (started && started.model) ?? '?'}`,
            `${j.tokens ?? count} tokens`,
            `${fmtRate(j.tok_s)} tok/s`,
          ];
          if (isNum(j.ms)) parts.push(`${j.ms.toFixed(1)} ms`);
          if (isNum(j.queued_ms)) parts.push(`queued ${j.queued_ms.toFixed(1)} ms`);
          if (j.sentinel_demoted) parts.push('drift sentinel demoted the fast path (finished on f32)');
          const spec = j.speculative;
          if (spec && isNum(spec.steps) && spec.steps > 0)
            parts.push(`speculative: ${(spec.tokens / spec.steps).toFixed(2)} tokens per verify step (${spec.lanes_run} lanes)`);
          $('gen-info').textContent = parts.join(' · ');
          $('gen-info').dataset.path = String(j.path ?? '');
          setGenState('done');
        } else if (type === 'error') {
          fail(`generate: ${j.error ?? data}`);
        }
      });
      const reader = res.body.getReader();
      const dec = new TextDecoder();
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        parser.feed(dec.decode(value, {stream: true}));
        if (finished) break;
      }
      parser.feed(dec.decode());
      parser.end();
      if (finished) reader.cancel().catch(() => {});
      out.scrollTop = out.scrollHeight;
      if (!finished) fail(`generate: the stream ended after ${count} tokens without a done event`);
    } catch (e) {
      if (e && e.name === 'AbortError') {
        setGenState('idle');
        $('gen-info').textContent = `stopped after ${count} tokens (${((performance.now() - t0) / 1000).toFixed(1)}s)`;
      } else {
        fail(`generate: ${e && e.message ? e.message : e}`);
      }
    } finally {
      state.generating = null;
      $('generate').disabled = false;
      $('stop').disabled = true;
    }
  }

  $('generate').addEventListener('click', generate);
  $('stop').addEventListener('click', () => {
    if (state.generating) state.generating.abort();
  });
  $('prompt').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      generate();
    }
  });

  // ---------- fine-tune ----------

  function updateTextInfo() {
    const t = $('ft-text').value;
    $('ft-text-info').textContent = t ? `· ${t.length.toLocaleString('en-US')} characters` : '';
  }
  $('ft-text').addEventListener('input', updateTextInfo);

  $('ft-file').addEventListener('change', () => {
    const f = $('ft-file').files && $('ft-file').files[0];
    if (!f) return;
    const r = new FileReader();
    r.onload = () => {
      $('ft-text').value = String(r.result);
      updateTextInfo();
      $('ft-text-info').textContent += ` from ${f.name} (${fmtBytes(f.size)})`;
    };
    r.onerror = () => showError(`reading ${f.name}: ${r.error ? r.error.message : 'failed'}`);
    r.readAsText(f);
  });

  function num(id, key) {
    const v = $(id).value.trim();
    const n = Number(v);
    if (v === '' || !Number.isFinite(n)) throw new Error(`${key}: not a number`);
    return n;
  }

  $('ft-start').addEventListener('click', async () => {
    clearError();
    let body;
    try {
      body = {
        text: $('ft-text').value,
        steps: num('ft-steps', 'steps'),
        lr: num('ft-lr', 'lr'),
        batch_size: num('ft-batch', 'batch_size'),
      };
      const seed = $('ft-seed').value.trim();
      if (seed !== '') body.seed = num('ft-seed', 'seed');
    } catch (e) {
      showError(e.message);
      return;
    }
    $('ft-start').disabled = true;
    try {
      const t = await postJson('/api/train', body);
      applyTrain(t);
    } catch (e) {
      showError(e.message);
      applyTrain(state.train);
    }
  });

  $('ft-stop').addEventListener('click', async () => {
    try {
      applyTrain(await postJson('/api/train/stop', {}));
    } catch (e) {
      showError(e.message);
    }
  });

  function applyTrain(t) {
    if (!t || typeof t !== 'object') {
      $('ft-start').disabled = false;
      return;
    }
    state.train = t;
    const running = t.state === 'running';
    $('ft-start').disabled = running;
    $('ft-stop').disabled = !running;

    const p = $('ft-progress');
    p.dataset.state = String(t.state ?? 'idle');
    if (t.state === 'idle' || !t.state) {
      p.textContent = 'no fine-tune yet';
    } else {
      const parts = [
        String(t.state),
        `step ${t.step ?? 0}/${t.steps ?? '?'}`,
        `train loss ${fmtLoss(t.train_loss)}`,
        `val loss ${fmtLoss(t.val_loss)}`,
        `${fmtRate(t.tok_s)} tok/s`,
      ];
      if (running) parts.push(`ETA ${fmtDuration(t.eta_s)}`);
      if (t.path) parts.push(`path ${t.path}`);
      p.textContent = parts.join(' · ');
      if (t.state === 'failed' && t.error) {
        p.textContent += ` — ${t.error}`;
      }
    }
    if (t.state === 'failed' && t.error && t.error !== state.lastTrainError) {
      state.lastTrainError = t.error;
      showError(`fine-tune failed: ${t.error}`);
    }

    const a = $('ft-download');
    if (t.checkpoint) {
      a.setAttribute('href', '/api/checkpoint');
      a.setAttribute('aria-disabled', 'false');
    } else {
      a.removeAttribute('href');
      a.setAttribute('aria-disabled', 'true');
    }
    const ftOpt = $('model').querySelector('option[value="finetuned"]');
    ftOpt.disabled = !t.checkpoint;
    if (!t.checkpoint && $('model').value === 'finetuned') $('model').value = 'base';

    drawChart();
  }

  // ---------- loss chart ----------

  function niceTicks(lo, hi, want) {
    const range = hi - lo;
    if (!(range > 0)) return [lo];
    const raw = range / Math.max(1, want);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const norm = raw / mag;
    const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
    const ticks = [];
    for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) ticks.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return ticks;
  }

  function tickLabel(v, ticks) {
    const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : 1;
    const d = step >= 1 ? 0 : Math.min(4, Math.ceil(-Math.log10(step)));
    return v.toFixed(d);
  }

  function drawChart() {
    const c = $('loss-chart');
    const t = state.train;
    const losses = t && Array.isArray(t.losses) ? t.losses : [];
    const train = losses.filter((p) => p && isNum(p.step) && isNum(p.train_loss));
    const val = losses.filter((p) => p && isNum(p.step) && isNum(p.val_loss));
    c.dataset.points = String(train.length);
    c.dataset.valPoints = String(val.length);

    const cssW = c.clientWidth;
    const cssH = c.clientHeight;
    if (!cssW || !cssH) return; // hidden tab: redrawn when shown
    const dpr = window.devicePixelRatio || 1;
    if (c.width !== Math.round(cssW * dpr) || c.height !== Math.round(cssH * dpr)) {
      c.width = Math.round(cssW * dpr);
      c.height = Math.round(cssH * dpr);
    }
    const g = c.getContext('2d');
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);

    const cs = getComputedStyle(document.documentElement);
    const col = (n, d) => (cs.getPropertyValue(n).trim() || d);
    const cText = col('--muted', '#666');
    const cGrid = col('--grid', '#ddd');
    const cAxis = col('--border-strong', '#999');
    const cTrain = col('--accent', '#2563eb');
    const cVal = col('--warn', '#d97706');
    const font = '11px ' + (col('--mono', 'monospace'));
    g.font = font;

    const L = 48, R = 14, T = 14, B = 36;
    const W = cssW - L - R, H = cssH - T - B;
    if (W < 20 || H < 20) return;

    if (!train.length && !val.length) {
      g.fillStyle = cText;
      g.textAlign = 'center';
      g.textBaseline = 'middle';
      g.fillText(t && t.state === 'running' ? 'waiting for the first step…' : 'loss chart: start a fine-tune', L + W / 2, T + H / 2);
      return;
    }

    const allY = train.map((p) => p.train_loss).concat(val.map((p) => p.val_loss));
    let yLo = Math.min(...allY), yHi = Math.max(...allY);
    if (yHi - yLo < 1e-6) { yLo -= 0.5; yHi += 0.5; }
    const padY = (yHi - yLo) * 0.08;
    yLo -= padY; yHi += padY;
    const lastStep = Math.max(...losses.filter((p) => p && isNum(p.step)).map((p) => p.step), 1);
    const xHi = Math.max(isNum(t.steps) ? t.steps : 0, lastStep, 1);
    const xLo = 0;
    const X = (s) => L + ((s - xLo) / (xHi - xLo)) * W;
    const Y = (v) => T + (1 - (v - yLo) / (yHi - yLo)) * H;

    // grid + ticks
    g.lineWidth = 1;
    const yt = niceTicks(yLo, yHi, 4);
    g.textAlign = 'right';
    g.textBaseline = 'middle';
    for (const v of yt) {
      const y = Math.round(Y(v)) + 0.5;
      g.strokeStyle = cGrid;
      g.beginPath(); g.moveTo(L, y); g.lineTo(L + W, y); g.stroke();
      g.fillStyle = cText;
      g.fillText(tickLabel(v, yt), L - 6, y);
    }
    const xt = niceTicks(xLo, xHi, 6).filter((v) => Number.isInteger(v) || xHi < 6);
    g.textAlign = 'center';
    g.textBaseline = 'top';
    for (const v of xt) {
      const x = Math.round(X(v)) + 0.5;
      g.strokeStyle = cGrid;
      g.beginPath(); g.moveTo(x, T); g.lineTo(x, T + H); g.stroke();
      g.fillStyle = cText;
      g.fillText(tickLabel(v, xt), x, T + H + 6);
    }
    // axes
    g.strokeStyle = cAxis;
    g.beginPath();
    g.moveTo(L + 0.5, T); g.lineTo(L + 0.5, T + H + 0.5); g.lineTo(L + W, T + H + 0.5);
    g.stroke();
    g.fillStyle = cText;
    g.textAlign = 'center';
    g.textBaseline = 'bottom';
    g.fillText('step', L + W / 2, cssH - 2);
    g.save();
    g.translate(11, T + H / 2);
    g.rotate(-Math.PI / 2);
    g.textAlign = 'center';
    g.textBaseline = 'middle';
    g.fillText('loss', 0, 0);
    g.restore();

    // train line
    g.strokeStyle = cTrain;
    g.fillStyle = cTrain;
    g.lineWidth = 1.75;
    g.lineJoin = 'round';
    g.beginPath();
    train.forEach((p, i) => (i ? g.lineTo(X(p.step), Y(p.train_loss)) : g.moveTo(X(p.step), Y(p.train_loss))));
    g.stroke();
    if (train.length < 40) {
      for (const p of train) { g.beginPath(); g.arc(X(p.step), Y(p.train_loss), 2, 0, Math.PI * 2); g.fill(); }
    }
    // val points
    g.fillStyle = cVal;
    g.strokeStyle = col('--panel', '#fff');
    g.lineWidth = 1.5;
    for (const p of val) {
      g.beginPath(); g.arc(X(p.step), Y(p.val_loss), 4, 0, Math.PI * 2); g.fill(); g.stroke();
    }

    // legend
    g.font = font;
    g.textBaseline = 'middle';
    g.textAlign = 'left';
    const lastT = train.length ? train[train.length - 1].train_loss : null;
    const lastV = val.length ? val[val.length - 1].val_loss : null;
    const items = [
      ['train' + (lastT !== null ? ' ' + lastT.toFixed(3) : ''), cTrain, 'line'],
      ['val' + (lastV !== null ? ' ' + lastV.toFixed(3) : ''), cVal, 'dot'],
    ];
    let lx = L + W - 8;
    for (let i = items.length - 1; i >= 0; i--) {
      const [label, color, kind] = items[i];
      const w = g.measureText(label).width;
      lx -= w;
      g.fillStyle = cText;
      g.fillText(label, lx, T + 6);
      lx -= 6;
      g.strokeStyle = color;
      g.fillStyle = color;
      if (kind === 'line') {
        g.lineWidth = 2;
        g.beginPath(); g.moveTo(lx - 14, T + 6); g.lineTo(lx, T + 6); g.stroke();
        lx -= 14;
      } else {
        g.beginPath(); g.arc(lx - 4, T + 6, 3.5, 0, Math.PI * 2); g.fill();
        lx -= 8;
      }
      lx -= 14;
    }
  }

  let resizeTimer = 0;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(drawChart, 80);
  });
  if (window.matchMedia) {
    const mq = window.matchMedia('(prefers-color-scheme: dark)');
    if (mq.addEventListener) mq.addEventListener('change', drawChart);
  }

  // ---------- event stream ----------

  function parseEventData(e) {
    try {
      return JSON.parse(e.data);
    } catch (_) {
      return null;
    }
  }

  function connect() {
    const conn = $('conn');
    const es = new EventSource('/api/events');
    es.addEventListener('open', () => {
      conn.dataset.state = 'open';
      conn.title = 'event stream connected';
    });
    es.addEventListener('error', () => {
      // EventSource reconnects by itself (CONNECTING). CLOSED means the server answered with
      // an error (e.g. 503: too many subscribers): try again a little later.
      if (es.readyState === EventSource.CLOSED) {
        conn.dataset.state = 'closed';
        conn.title = 'event stream refused — retrying in 5s';
        setTimeout(connect, 5000);
      } else {
        conn.dataset.state = 'reconnecting';
        conn.title = 'event stream lost — reconnecting';
      }
    });
    es.addEventListener('hello', (e) => {
      const j = parseEventData(e);
      if (!j) return;
      state.gotHello = true;
      if (j.status) { state.status = j.status; renderStatus(); }
      if (j.caps) { state.caps = j.caps; renderCaps(); }
      if (Array.isArray(j.gates)) { state.gates = j.gates.map(String); renderGates(); }
      if (j.train) applyTrain(j.train);
    });
    es.addEventListener('status', (e) => {
      const j = parseEventData(e);
      if (j) { state.status = j; renderStatus(); }
    });
    es.addEventListener('caps', (e) => {
      const j = parseEventData(e);
      if (j) { state.caps = j; renderCaps(); }
    });
    es.addEventListener('gate', (e) => {
      const j = parseEventData(e);
      if (j && j.line !== undefined) appendGate(j.line);
    });
    es.addEventListener('train', (e) => {
      const j = parseEventData(e);
      if (j) applyTrain(j);
    });
    return es;
  }

  // ---------- start ----------

  renderStatus();
  renderCaps();
  renderGates();
  drawChart();
  connect();
  document.documentElement.dataset.app = 'loaded'; // for tests: the script ran

  // The hello event carries everything; these fill in if it is slow, and never overwrite it.
  getJson('/api/info').then((i) => { state.info = i; renderInfo(); }).catch((e) => showError(e.message));
  getJson('/api/status').then((s) => { if (!state.gotHello) { state.status = s; renderStatus(); } }).catch(() => {});
  getJson('/api/caps').then((c) => { if (!state.gotHello) { state.caps = c; renderCaps(); } }).catch(() => {});
  getJson('/api/gates').then((g) => { if (!state.gotHello && g && Array.isArray(g.lines)) { state.gates = g.lines.map(String); renderGates(); } }).catch(() => {});
  getJson('/api/train').then((t) => { if (!state.gotHello) applyTrain(t); }).catch(() => {});
})();
