// Timeline: host threads, GPU streams, counters and the steps band of one rank, drawn on a
// canvas from level-of-detail windows the server computes for the visible range and width
// (analysis/timeline.py), so the browser never holds the whole trace.
// Mouse: wheel zooms at the pointer, drag pans, click selects. Keys: w/s zoom, a/d pan, f fits.
import { api } from '../api.js';
import { esc, ns, us, bytes, short, h } from '../fmt.js';

const LEFT = 230, RULER = 22, ROW = 14, GAP = 1, HEAD = 16, COUNTER = 34;
const SRC_HUE = { python: 95, ops: 200, runtime: 20, annotations: 280, kernels: 215, memops: 140, steps: 0, gpu_sync: 355 };

function hashHue(s) { let x = 0; for (let i = 0; i < s.length; i++) x = (x * 31 + s.charCodeAt(i)) | 0; return Math.abs(x) % 360; }
function color(name, source) {
  if (source === 'steps') return '#d9d9d9';
  if (source === 'kernels' && /nccl/i.test(name)) return 'hsl(30,80%,55%)';
  const base = SRC_HUE[source] ?? 0;
  return `hsl(${(base + (hashHue(name) % 50) - 25 + 360) % 360},${source === 'kernels' ? 55 : 40}%,${source === 'runtime' ? 62 : 58}%)`;
}
function niceStep(span, n) { const raw = span / n, p = 10 ** Math.floor(Math.log10(raw)); for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p; return 10 * p; }

export default async function timeline(root, { rank, params }) {
  const L = await api('timeline/lanes', { rank });
  root.appendChild(h(`<div class="tl-bar">
    <input id="tl-search" placeholder="search events (name contains), Enter" size="34">
    <button id="tl-fit" title="f">fit</button><button id="tl-in" title="w">zoom in</button><button id="tl-out" title="s">zoom out</button>
    <span class="hint">wheel: zoom · drag: pan · w/s zoom · a/d pan · f fit selection · click: select</span>
    <span id="tl-status" class="hint"></span></div>`));
  const main = h(`<div class="tl-main"><div class="tl-scroll" id="tl-scroll"><canvas id="tl-canvas" tabindex="0"></canvas></div>
    <div class="tl-side"><div id="tl-results"></div><div id="tl-details" class="hint">Select an event.</div></div></div>`);
  root.appendChild(main);
  if (!L.hw) main.querySelector('#tl-results').innerHTML = '<div class="empty" id="tl-nohw">No hardware counter tracks: this capture has no hw.csv.</div>';
  const canvas = main.querySelector('#tl-canvas');
  const scroll = main.querySelector('#tl-scroll');
  const ctx = canvas.getContext('2d');
  const status = root.querySelector('#tl-status');

  // layout: one row per lane, a header row whenever the track changes, counters at the end
  const rows = [];
  let y = RULER, prevTrack = null;
  for (const lane of L.lanes) {
    if (lane.track !== prevTrack && lane.group !== 'steps') { rows.push({ head: lane.track, y, hgt: HEAD }); y += HEAD; prevTrack = lane.track; }
    const hgt = lane.group === 'steps' ? 18 : ROW;
    rows.push({ lane, y, hgt }); y += hgt + GAP;
  }
  if (L.counters.length) { rows.push({ head: 'counters', y, hgt: HEAD }); y += HEAD; }
  for (const c of L.counters) { rows.push({ counter: c, y, hgt: COUNTER }); y += COUNTER + GAP; }
  const totalH = y + 8;
  const laneRow = new Map(rows.filter((r) => r.lane).map((r) => [r.lane.id, r]));

  const S = { t0: +(params.get('t0') ?? L.start), t1: +(params.get('t1') ?? L.end), data: null, counters: {}, sel: null, detail: null,
    fetches: 0, lastFetchMs: null, pending: null, mouseX: null, inputT: 0, fresh: null, lastFrame: null };
  if (!(S.t1 > S.t0)) { S.t0 = L.start; S.t1 = L.end; }
  let W = 800;
  const plotW = () => W - LEFT;
  const toX = (t) => LEFT + ((t - S.t0) / (S.t1 - S.t0)) * plotW();
  const toT = (x) => S.t0 + ((x - LEFT) / plotW()) * (S.t1 - S.t0);

  function resize() {
    W = Math.max(400, scroll.clientWidth - 2);
    const dpr = window.devicePixelRatio || 1;
    canvas.width = W * dpr; canvas.height = totalH * dpr;
    canvas.style.width = W + 'px'; canvas.style.height = totalH + 'px';
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  }

  // A tick label with just enough decimals that neighbouring ticks differ at any zoom.
  function tickLabel(t, step) {
    const [scale, unit] = Math.abs(t) >= 1e9 ? [1e9, 's'] : [1e6, 'ms'];
    const dec = Math.min(9, Math.max(0, Math.ceil(-Math.log10(step / scale))));
    return `${(t / scale).toFixed(dec)} ${unit}`;
  }

  function draw() {
    ctx.clearRect(0, 0, W, totalH);
    ctx.font = '10px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    // ruler
    const span = S.t1 - S.t0, step = niceStep(span, 10);
    ctx.fillStyle = '#f4f4f4'; ctx.fillRect(LEFT, 0, plotW(), RULER);
    ctx.strokeStyle = '#e3e3e3'; ctx.fillStyle = '#555';
    for (let t = Math.ceil(S.t0 / step) * step; t < S.t1; t += step) {
      const x = toX(t);
      ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, totalH); ctx.stroke();
      ctx.fillText(tickLabel(t, step), x + 2, RULER / 2);
    }
    const byLane = new Map((S.data?.lanes || []).map((e) => [e.id, e]));
    const names = S.data?.names || {};
    for (const r of rows) {
      if (r.head) {
        ctx.fillStyle = '#eef1f5'; ctx.fillRect(0, r.y, W, r.hgt);
        ctx.fillStyle = '#223'; ctx.font = 'bold 10px system-ui, sans-serif'; ctx.fillText(short(r.head, 60), 4, r.y + r.hgt / 2); ctx.font = '10px system-ui, sans-serif';
        continue;
      }
      ctx.fillStyle = '#444';
      if (r.lane) ctx.fillText(r.lane.group === 'steps' ? 'steps' : (r.lane.group === 'gpu' ? (r.lane.kind === 'annotations' ? `annotations ${r.lane.depth}` : r.lane.kind) : `depth ${r.lane.depth}`), 10, r.y + r.hgt / 2);
      ctx.save(); ctx.beginPath(); ctx.rect(LEFT, r.y, plotW(), r.hgt); ctx.clip();
      if (r.counter) drawCounter(r);
      const e = r.lane && byLane.get(r.lane.id);
      if (e) {
        if (e.summary) {
          const cw = plotW() / S.data.px;
          const x0 = toX(S.data.t0), sc = (S.data.t1 - S.data.t0) / (S.t1 - S.t0);
          for (let i = 0; i < e.summary.col.length; i++) {
            ctx.fillStyle = `rgba(90,100,120,${0.2 + 0.7 * e.summary.busy[i]})`;
            ctx.fillRect(x0 + e.summary.col[i] * cw * sc, r.y, Math.max(1, cw * sc), r.hgt);
          }
        }
        const ev = e.events;
        for (let i = 0; i < ev.start.length; i++) {
          const x0 = toX(ev.start[i]), x1 = toX(ev.end[i]);
          if (x1 < LEFT || x0 > W) continue;
          const nm = names[ev.name[i]] ?? '', src = L.sources[ev.source[i]];
          const w = Math.max(1, x1 - x0);
          ctx.fillStyle = color(nm, src);
          ctx.fillRect(x0, r.y, w, r.hgt);
          if (w > 28) { ctx.fillStyle = '#111'; ctx.fillText(short(nm, Math.floor(w / 5.5)), Math.max(x0, LEFT) + 2, r.y + r.hgt / 2); }
        }
      }
      ctx.restore();
    }
    // selection: the event, its launching op and runtime call, and the launch -> GPU flow arrow
    const d = S.detail;
    if (d && d.ref) {
      const box = (ref, style, lw) => {
        const r = laneRow.get(ref.lane); if (!r) return null;
        const x0 = Math.max(LEFT - 4, toX(ref.start)), x1 = Math.min(W + 4, Math.max(toX(ref.end), toX(ref.start) + 2));
        ctx.strokeStyle = style; ctx.lineWidth = lw; ctx.strokeRect(x0, r.y - 1, x1 - x0, r.hgt + 2); ctx.lineWidth = 1;
        return { x: (x0 + x1) / 2, xs: toX(ref.start), top: r.y - 1, bottom: r.y + r.hgt + 1 };
      };
      if (d.op) box(d.op, '#7a00cc', 2);
      const a = d.launch && box(d.launch, '#d62728', 2);
      const b = box(d.ref, '#000', 2);
      if (a && b) {
        const x0 = Math.min(Math.max(a.x, LEFT), W), x1 = Math.min(Math.max(b.xs, LEFT), W);
        const y0 = a.bottom, y1 = b.top;
        ctx.strokeStyle = '#d62728'; ctx.fillStyle = '#d62728'; ctx.lineWidth = 1.5;
        ctx.beginPath(); ctx.moveTo(x0, y0); ctx.bezierCurveTo(x0, (y0 + y1) / 2, x1, (y0 + y1) / 2, x1, y1); ctx.stroke();
        ctx.beginPath(); ctx.moveTo(x1, y1); ctx.lineTo(x1 - 4, y1 - 7); ctx.lineTo(x1 + 4, y1 - 7); ctx.closePath(); ctx.fill();
        ctx.lineWidth = 1;
      }
      for (const k of d.launched || []) box(k, '#d62728', 2);
    }
    ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, LEFT - 1, RULER);
    ctx.fillStyle = '#555'; ctx.fillText(`rank ${rank} · ${L.events.toLocaleString()} events`, 4, RULER / 2);
  }

  function drawCounter(r) {
    const c = S.counters[r.counter.id];
    ctx.fillStyle = '#444'; ctx.save(); ctx.restore();
    if (!c || !c.ts.length) return;
    let max = 0; for (const v of c.value) max = Math.max(max, v); for (const v of [c.before, c.after]) if (v != null) max = Math.max(max, v);
    max = max || 1;
    ctx.strokeStyle = '#2a7'; ctx.fillStyle = 'rgba(40,170,120,0.2)';
    ctx.beginPath();
    const yv = (v) => r.y + r.hgt - (v / max) * (r.hgt - 4);
    ctx.moveTo(LEFT, r.y + r.hgt);
    if (r.counter.id.startsWith('hw:')) {
      // a hw.csv sample covers the period since the previous sample: the value holds before its time
      let yy = yv(c.value[0]); ctx.lineTo(LEFT, yy);
      for (let i = 0; i < c.ts.length; i++) { const nx = toX(c.ts[i]); yy = yv(c.value[i]); ctx.lineTo(nx, yy); if (i + 1 < c.ts.length) ctx.lineTo(nx, yv(c.value[i + 1])); }
      const last = toX(c.ts[c.ts.length - 1]);
      if (c.after != null) { ctx.lineTo(last, yv(c.after)); ctx.lineTo(W, yv(c.after)); ctx.lineTo(W, r.y + r.hgt); } else ctx.lineTo(last, r.y + r.hgt);
    } else {
      let yy = yv(c.before ?? c.value[0]); ctx.lineTo(LEFT, yy);
      for (let i = 0; i < c.ts.length; i++) { const nx = toX(c.ts[i]); ctx.lineTo(nx, yy); yy = yv(c.value[i]); ctx.lineTo(nx, yy); }
      ctx.lineTo(W, yy); ctx.lineTo(W, r.y + r.hgt);
    }
    ctx.closePath(); ctx.fill(); ctx.stroke();
    ctx.fillStyle = '#333';
    ctx.fillText(`max ${r.counter.unit === 'bytes' ? bytes(max) : max.toFixed(1)}`, LEFT + 4, r.y + 7);
  }

  function labelCounters() {
    // counter names in the gutter (drawn outside the clip)
    for (const r of rows) if (r.counter) { ctx.fillStyle = '#444'; ctx.fillText(short(r.counter.name, 36), 10, r.y + r.hgt / 2); }
  }

  let frame = 0;
  // S.lastFrame: when the first redraw with a newly fetched window finished, and since which input
  // (performance.now() ms) -- read by bench/ui_timeline_browser.py; one small object per fetch.
  const redraw = () => { if (!frame) frame = requestAnimationFrame(() => {
    frame = 0; draw(); labelCounters();
    if (S.fresh) { S.lastFrame = { ...S.fresh, done: performance.now() }; S.fresh = null; }
  }); };

  let timer = null, ctrl = null;
  function fetchWindow() {
    clearTimeout(timer);
    timer = setTimeout(async () => {
      if (ctrl) ctrl.abort();
      ctrl = new AbortController();
      const px = Math.round(plotW()), t0 = Math.floor(S.t0), t1 = Math.ceil(S.t1);
      const t = performance.now(), inputT = S.inputT;
      const p = Promise.all([api('timeline/window', { rank, t0, t1, px }, ctrl.signal),
        L.counters.length ? api('timeline/counters', { rank, t0, t1, px }, ctrl.signal) : Promise.resolve({ counters: {} })]);
      S.pending = p;
      try {
        const [w, c] = await p;
        S.data = w; S.counters = c.counters; S.fetches++;
        S.lastFetchMs = performance.now() - t;
        const n = w.lanes.reduce((a, e) => a + e.events.start.length, 0);
        S.fresh = { seq: S.fetches, input: inputT, fetched: performance.now(), t0, t1, events: n };
        status.textContent = `${ns(t1 - t0)} visible · ${n} events drawn${w.truncated ? ' (truncated)' : ''} · ${S.lastFetchMs.toFixed(0)} ms`;
        redraw();
      } catch (e) { if (e.name !== 'AbortError') status.textContent = e.message; }
      finally { if (S.pending === p) S.pending = null; }
    }, 25);
  }
  const setView = (t0, t1) => {
    const minSpan = 1000, full = L.end - L.start;
    let span = Math.max(minSpan, Math.min(t1 - t0, full * 1.2));
    let mid = (t0 + t1) / 2;
    S.t0 = mid - span / 2; S.t1 = mid + span / 2; S.inputT = performance.now();
    redraw(); fetchWindow();
  };
  const zoom = (f, at) => { const t = toT(at ?? (LEFT + plotW() / 2)); setView(t - (t - S.t0) * f, t + (S.t1 - t) * f); };
  const pan = (frac) => { const d = (S.t1 - S.t0) * frac; setView(S.t0 + d, S.t1 + d); };
  const fit = () => {
    const d = S.detail?.ref;
    if (d) { const refs = [d, S.detail.launch, S.detail.op].filter(Boolean); const a = Math.min(...refs.map((r) => r.start)), b = Math.max(...refs.map((r) => r.end)); const m = Math.max((b - a) * 0.15, 500); setView(a - m, b + m); }
    else setView(L.start, L.end);
  };

  async function select(source, row) {
    const d = await api('timeline/event', { rank, source, row });
    S.sel = { source, row }; S.detail = d;
    renderDetail(d);
    redraw();
    return d;
  }

  function refLink(label, ref, id) {
    return ref ? `<div class="ref" id="${id}"><b>${label}</b> <a href="#" data-src="${ref.source}" data-row="${ref.row}">${esc(short(ref.name, 80))}</a> <span class="hint">${ns(ref.end - ref.start)}</span></div>` : '';
  }
  function renderDetail(d) {
    const el = main.querySelector('#tl-details');
    const a = d.args || {}, r = d.ref;
    el.className = '';
    el.innerHTML = `<h4 id="tl-sel-name">${esc(r ? r.name : a.name || '')}</h4>
      <div class="hint">${esc(r ? r.source : '')} · start ${r ? ns(r.start) : '–'} · duration ${r ? ns(r.end - r.start) : '–'}</div>
      ${refLink('launched by', d.launch, 'tl-launch')}${refLink('launching op', d.op, 'tl-op')}
      ${(d.launched || []).map((k) => refLink('launched', k, 'tl-launched')).join('')}
      ${d.stack ? `<details open><summary>host stack (${d.stack.length})</summary><ol class="stack">${d.stack.map((f) => `<li><span class="hint">${f.kind}</span> ${esc(short(f.name, 90))}</li>`).join('')}</ol></details>` : ''}
      <details open><summary>fields</summary><table class="kv">${Object.entries(a).map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(short(String(v), 120))}</td></tr>`).join('')}</table></details>`;
    for (const link of el.querySelectorAll('a[data-src]')) link.onclick = (e) => { e.preventDefault(); select(link.dataset.src, +link.dataset.row).then(fit); };
  }

  // mouse
  let drag = null;
  canvas.addEventListener('wheel', (e) => {
    if (e.shiftKey) return; // shift+wheel scrolls the tracks
    e.preventDefault();
    const r = canvas.getBoundingClientRect();
    zoom(Math.exp(e.deltaY * 0.0015), e.clientX - r.left);
  }, { passive: false });
  canvas.addEventListener('mousedown', (e) => { drag = { x: e.clientX, t0: S.t0, t1: S.t1, moved: false }; canvas.focus(); });
  const onMove = (e) => {
    const r = canvas.getBoundingClientRect(); S.mouseX = e.clientX - r.left;
    if (!drag) return;
    const dx = e.clientX - drag.x; if (Math.abs(dx) > 2) drag.moved = true;
    const dt = (dx / plotW()) * (drag.t1 - drag.t0);
    S.t0 = drag.t0 - dt; S.t1 = drag.t1 - dt; S.inputT = performance.now(); redraw(); fetchWindow();
  };
  window.addEventListener('mousemove', onMove);
  const up = (e) => {
    if (!drag) return;
    const moved = drag.moved; drag = null;
    if (moved) return;
    const r = canvas.getBoundingClientRect(), x = e.clientX - r.left, yy = e.clientY - r.top;
    const row = rows.find((q) => q.lane && yy >= q.y && yy < q.y + q.hgt);
    if (!row || x < LEFT || !S.data) return;
    const ent = S.data.lanes.find((q) => q.id === row.lane.id);
    if (!ent) return;
    const t = toT(x), tol = (3 / plotW()) * (S.t1 - S.t0), ev = ent.events;
    let best = -1, bd = Infinity;
    for (let i = 0; i < ev.start.length; i++) {
      const dd = t < ev.start[i] ? ev.start[i] - t : t > ev.end[i] ? t - ev.end[i] : 0;
      if (dd <= tol && dd < bd) { bd = dd; best = i; }
    }
    if (best >= 0) {
      const src = L.sources[ev.source[best]];
      if (src === 'steps') setView(ev.start[best], ev.end[best]);
      select(src, ev.row[best]);
    }
  };
  window.addEventListener('mouseup', up);
  const onKey = (e) => {
    if (e.target.tagName === 'INPUT' || e.target.tagName === 'SELECT' || e.ctrlKey || e.metaKey || e.altKey) return;
    const k = e.key.toLowerCase();
    const at = S.mouseX != null && S.mouseX > LEFT && S.mouseX < W ? S.mouseX : undefined;
    if (k === 'w') zoom(0.7, at); else if (k === 's') zoom(1 / 0.7, at);
    else if (k === 'a') pan(-0.2); else if (k === 'd') pan(0.2); else if (k === 'f') fit(); else return;
    e.preventDefault();
  };
  window.addEventListener('keydown', onKey);
  root.querySelector('#tl-fit').onclick = fit;
  root.querySelector('#tl-in').onclick = () => zoom(0.7);
  root.querySelector('#tl-out').onclick = () => zoom(1 / 0.7);

  // search
  const sIn = root.querySelector('#tl-search');
  sIn.addEventListener('keydown', async (e) => {
    if (e.key !== 'Enter' || !sIn.value.trim()) return;
    const res = await api('timeline/search', { rank, q: sIn.value.trim(), limit: 100 });
    const box = main.querySelector('#tl-results');
    box.innerHTML = `<div class="hint" id="tl-hits">${res.total} match(es)${res.total > res.events.length ? `, first ${res.events.length}` : ''}</div>
      <ul class="hits">${res.events.map((x, i) => `<li><a href="#" data-i="${i}">${ns(x.start)} · ${esc(short(x.name, 60))}</a> <span class="hint">${x.source}</span></li>`).join('')}</ul>`;
    for (const a of box.querySelectorAll('a[data-i]')) a.onclick = (ev) => { ev.preventDefault(); const x = res.events[+a.dataset.i]; select(x.source, x.row).then(fit); };
  });

  const ro = new ResizeObserver(() => { resize(); redraw(); fetchWindow(); });
  ro.observe(scroll);
  resize();
  window.__aiprof.timeline = { S, L, select, fit, zoom, pan, setView, get view() { return { t0: S.t0, t1: S.t1 }; } };
  await new Promise((res) => { const t0 = performance.now(); const poll = () => (S.data || performance.now() - t0 > 15000 ? res() : setTimeout(poll, 20)); fetchWindow(); poll(); });
  return () => { ro.disconnect(); window.removeEventListener('keydown', onKey); window.removeEventListener('mouseup', up); window.removeEventListener('mousemove', onMove); if (ctrl) ctrl.abort(); clearTimeout(timer); delete window.__aiprof.timeline; };
}
