// Timeline: several ranks side by side on the aligned clock (the cross-rank analysis's clock
// offsets), each a collapsible tree in the spirit of Perfetto: rank -> host process -> threads
// (one row per nesting depth); GPU -> streams (annotations, kernels/memcpy, sync); counters.
// Drawn on a canvas from level-of-detail windows the server computes for the visible range, the
// visible rows and the width (analysis/timeline.py), so the browser never holds the whole trace.
//
// Mouse: wheel zooms at the pointer, drag pans, shift+drag marks a range, click selects, a click
// in the left column opens/closes a group. Keys: w/s or ↑/↓ zoom, a/d or ←/→ pan, f frames the
// selection (or the range, or everything), n / shift+n (also ] / [) next / previous event with the
// same name, l flows (launch -> GPU) for the range or the view, Esc clears, / searches.
import { api } from '../api.js';
import { esc, ns, us, bytes, short, h, elide, eventName } from '../fmt.js';

const LEFT = 250, RULER = 22, ROW = 14, GAP = 1, HEAD = 16, COUNTER = 34, INDENT = 10;
const MAX_RANKS = 8; // ranks drawn at once by default (more: pick them in the list)
const SRC_HUE = { python: 95, ops: 200, runtime: 20, annotations: 280, kernels: 215, memops: 140, steps: 0, gpu_sync: 355 };

function hashHue(s) { let x = 0; for (let i = 0; i < s.length; i++) x = (x * 31 + s.charCodeAt(i)) | 0; return Math.abs(x) % 360; }
function color(name, source) {
  if (source === 'steps') return '#d9d9d9';
  if (source === 'kernels' && /nccl/i.test(name)) return 'hsl(30,80%,55%)';
  const base = SRC_HUE[source] ?? 0;
  return `hsl(${(base + (hashHue(name) % 50) - 25 + 360) % 360},${source === 'kernels' ? 55 : 40}%,${source === 'runtime' ? 62 : 58}%)`;
}
function niceStep(span, n) { const raw = span / n, p = 10 ** Math.floor(Math.log10(raw)); for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p; return 10 * p; }

// The tree of one rank's tracks. Leaves are lanes (one timeline row) and counter tracks.
function rankTree(L, meta) {
  const r = L.rank, dev = (meta.ranks.find((x) => x.rank === r) || {}).device || {};
  const root = { id: `r${r}`, rank: r, label: `rank ${r}${L.host ? ' · ' + L.host : ''}${dev.name ? ' · ' + dev.name : ''}`, children: [] };
  const procs = new Map(), gpus = new Map();
  let natives = null;
  for (const lane of L.lanes) {
    if (lane.group === 'steps') { root.children.push({ lane, label: 'steps' }); continue; }
    if (lane.group === 'native') { // traced library calls and sampled syscalls: one row per library/thread
      if (!natives) natives = { id: `r${r}:n`, rank: r, label: 'native (library calls, syscalls)', children: [] };
      natives.children.push({ lane, label: lane.depth ? `${lane.track} · depth ${lane.depth}` : lane.track });
      continue;
    }
    if (lane.group === 'host') {
      const pid = lane.proc;
      if (!procs.has(pid)) {
        const pname = L.processes[String(pid)];
        procs.set(pid, { id: `r${r}:p${pid}`, rank: r, label: `process ${pid < 0 ? '?' : pid}${pname ? ' (' + pname + ')' : ''}`, children: [], threads: new Map() });
      }
      const p = procs.get(pid);
      if (!p.threads.has(lane.thread)) {
        const t = { id: `r${r}:p${pid}:t${lane.thread}`, rank: r, label: lane.track, children: [], main: / · main$/.test(lane.track) };
        p.threads.set(lane.thread, t); p.children.push(t);
      }
      p.threads.get(lane.thread).children.push({ lane, label: `depth ${lane.depth}` });
    } else {
      const d = lane.proc;
      if (!gpus.has(d)) gpus.set(d, { id: `r${r}:g${d}`, rank: r, label: `GPU ${d}`, children: [], streams: new Map() });
      const g = gpus.get(d);
      if (!g.streams.has(lane.thread)) {
        const s = { id: `r${r}:g${d}:s${lane.thread}`, rank: r, label: `stream ${lane.thread}`, children: [] };
        g.streams.set(lane.thread, s); g.children.push(s);
      }
      const label = lane.kind === 'annotations' ? `annotations ${lane.depth}` : lane.kind === 'sync' ? 'sync' : /overlap/.test(lane.track) ? lane.track.replace(/^.*\((overlap \d+)\)$/, '$1') : 'kernels / memcpy';
      g.streams.get(lane.thread).children.push({ lane, label });
    }
  }
  // the GPU's PM counters (group 'gpu') go under the GPU tracks, the others (memory, hw.csv) in "counters"
  const pmC = L.counters.filter((c) => c.group === 'gpu'), other = L.counters.filter((c) => c.group !== 'gpu');
  if (pmC.length) {
    if (!gpus.size) gpus.set(0, { id: `r${r}:g0`, rank: r, label: 'GPU', children: [], streams: new Map() });
    gpus.values().next().value.children.push({ id: `r${r}:pm`, rank: r, label: `GPU counters (${pmC.length})`, children: pmC.map((c) => ({ counter: c, label: c.name })) });
  }
  root.children.push(...procs.values(), ...gpus.values(), ...(natives ? [natives] : []));
  if (other.length) root.children.push({ id: `r${r}:c`, rank: r, label: `counters (${other.length})`, children: other.map((c) => ({ counter: c, label: c.name })) });
  // a collapsed thread or stream still shows its top row (depth 0 / its kernels)
  const summary = (n) => n.children.find((c) => c.lane && (c.lane.group === 'host' ? c.lane.depth === 0 : c.label === 'kernels / memcpy')) || n.children.find((c) => c.lane);
  const walk = (n) => { if (n.children) { n.summary = summary(n)?.lane || null; n.children.forEach(walk); } };
  walk(root);
  return root;
}

export default async function timeline(root, { rank, meta, params }) {
  const all = meta.ranks.map((r) => r.rank);
  let shown = (params.get('ranks') || '').split(',').filter((x) => x !== '').map(Number).filter((x) => all.includes(x));
  if (!shown.length) shown = [rank, ...all.filter((x) => x !== rank)].slice(0, MAX_RANKS).sort((a, b) => a - b);
  const Ls = await Promise.all(shown.map((r) => api('timeline/lanes', { rank: r })));
  const LL = new Map(Ls.map((L) => [L.rank, L]));
  const sources = Ls[0].sources;
  const start = Math.min(...Ls.map((L) => L.start)), end = Math.max(...Ls.map((L) => L.end));

  root.appendChild(h(`<div class="tl-bar">
    <input id="tl-search" placeholder="search names in the ranks shown (/)" size="32" title="Enter: next hit · Shift+Enter: previous">
    <span id="tl-hitpos" class="hint"></span>
    <button id="tl-fit" title="f">frame</button><button id="tl-in" title="w">zoom in</button><button id="tl-out" title="s">zoom out</button>
    <button id="tl-flows" title="l">flows in range</button>
    <label class="hint"><input type="checkbox" id="tl-links" checked> collective links</label>
    <details class="tl-ranks"><summary>ranks (${shown.length} of ${all.length})</summary>${all.map((r) => `<label><input type="checkbox" value="${r}" ${shown.includes(r) ? 'checked' : ''}> ${r}</label>`).join(' ')} <button id="tl-ranks-apply">show</button></details>
    <span class="hint">wheel/w/s/↑/↓ zoom · drag/a/d/←/→ pan · shift+drag range · f frame · n/N next/prev same name · l flows · Esc clear</span>
    <span id="tl-status" class="hint"></span></div>`));
  const main = h(`<div class="tl-main"><div class="tl-scroll" id="tl-scroll"><canvas id="tl-canvas" tabindex="0"></canvas></div>
    <div class="tl-side"><div id="tl-details" class="hint">Select an event.</div><div id="tl-results"></div></div></div>`);
  root.appendChild(main);
  if (!Ls.some((L) => L.hw || L.counters.some((c) => c.group === 'gpu'))) main.querySelector('#tl-results').innerHTML = '<div class="empty" id="tl-nohw">No hardware counter tracks: this capture has no hw.csv.</div>';
  const canvas = main.querySelector('#tl-canvas');
  const scroll = main.querySelector('#tl-scroll');
  const ctx = canvas.getContext('2d');
  const status = root.querySelector('#tl-status');

  // ---- tree and layout -----------------------------------------------------------------------
  const trees = Ls.map((L) => rankTree(L, meta));
  const saved = JSON.parse(sessionStorage.getItem('aiprof.tl.open') || '{}');
  const open = new Map(Object.entries(saved));
  const isOpen = (n) => {
    if (open.has(n.id)) return open.get(n.id);
    if (/:c$|:pm$/.test(n.id)) return shown.length === 1; // counters: open when one rank is shown
    if (/:t\d+$|:t-?\d+$/.test(n.id)) return n.main && n.rank === shown[0]; // the first rank's main thread
    return true;
  };
  let rows = [], totalH = 0;
  const laneRow = new Map(); // `${rank}:${lane}` -> row
  const headRow = new Map(); // rank -> its header row
  const hiddenRow = new Map(); // `${rank}:${lane}` of a lane inside a closed group -> the group's row
  function layout() {
    rows = []; laneRow.clear(); headRow.clear(); hiddenRow.clear();
    let y = RULER;
    const add = (r) => { r.y = y; rows.push(r); y += r.hgt + (r.kind === 'head' ? 0 : GAP); return r; };
    const visit = (n, level, rk) => {
      if (n.lane) { laneRow.set(`${rk}:${n.lane.id}`, add({ kind: 'lane', rank: rk, lane: n.lane, label: n.label, level, hgt: n.lane.group === 'steps' ? 18 : ROW })); return; }
      if (n.counter) { add({ kind: 'counter', rank: rk, counter: n.counter, label: n.label, level, hgt: COUNTER }); return; }
      const o = isOpen(n);
      const carry = !o && n.summary && /:[ts]-?\d+$/.test(n.id) ? n.summary : null; // collapsed thread/stream: its top row
      const r = add({ kind: 'head', rank: n.rank, node: n, open: o, label: n.label, level, lane: carry, hgt: carry ? ROW + 2 : HEAD });
      if (carry) laneRow.set(`${n.rank}:${carry.id}`, r);
      if (level === 0) headRow.set(n.rank, r);
      if (o) for (const c of n.children) visit(c, level + 1, rk);
      else {
        const hide = (m) => { if (m.lane) hiddenRow.set(`${n.rank}:${m.lane.id}`, r); else if (m.children) m.children.forEach(hide); };
        n.children.forEach(hide);
      }
    };
    for (const t of trees) visit(t, 0, t.rank);
    totalH = y + 8;
  }
  const visibleLanes = (r) => [...laneRow.entries()].filter(([k]) => +k.split(':')[0] === r).map(([, row]) => row.lane.id);
  const countersOpen = (r) => rows.some((x) => x.kind === 'counter' && x.rank === r);

  const S = { t0: +(params.get('t0') ?? start), t1: +(params.get('t1') ?? end), data: new Map(), counters: new Map(), sel: null, detail: null,
    fetches: 0, lastFetchMs: null, pending: null, mouseX: null, inputT: 0, fresh: null, lastFrame: null, range: null, flows: null,
    coll: [], hits: null, hit: -1 };
  if (!(S.t1 > S.t0)) { S.t0 = start; S.t1 = end; }
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

  // ---- drawing -------------------------------------------------------------------------------
  function drawLane(r, e, src) {
    if (!e) return;
    const d = S.data.get(r.rank);
    if (e.summary) {
      const cw = plotW() / d.px, x0 = toX(d.t0), sc = (d.t1 - d.t0) / (S.t1 - S.t0);
      for (let i = 0; i < e.summary.col.length; i++) {
        ctx.fillStyle = `rgba(90,100,120,${0.2 + 0.7 * e.summary.busy[i]})`;
        ctx.fillRect(x0 + e.summary.col[i] * cw * sc, r.y, Math.max(1, cw * sc), r.hgt);
      }
    }
    const ev = e.events, names = d.names;
    for (let i = 0; i < ev.start.length; i++) {
      const x0 = toX(ev.start[i]), x1 = toX(ev.end[i]);
      if (x1 < LEFT || x0 > W) continue;
      const nm = names[ev.name[i]] ?? '', s = src[ev.source[i]];
      const w = Math.max(1, x1 - x0);
      ctx.fillStyle = color(nm, s);
      ctx.fillRect(x0, r.y, w, r.hgt);
      if (w > 28) {
        const vis = Math.min(x1, W) - Math.max(x0, LEFT);
        ctx.fillStyle = '#111';
        ctx.fillText(elide(eventName(nm, s), Math.floor(vis / 5.6)), Math.max(x0, LEFT) + 2, r.y + r.hgt / 2);
      }
    }
  }

  function draw() {
    ctx.clearRect(0, 0, W, totalH);
    ctx.font = '10px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    const span = S.t1 - S.t0, step = niceStep(span, 10);
    ctx.fillStyle = '#f4f4f4'; ctx.fillRect(LEFT, 0, plotW(), RULER);
    ctx.strokeStyle = '#e3e3e3'; ctx.fillStyle = '#555';
    for (let t = Math.ceil(S.t0 / step) * step; t < S.t1; t += step) {
      const x = toX(t);
      ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, totalH); ctx.stroke();
      ctx.fillText(tickLabel(t, step), x + 2, RULER / 2);
    }
    if (S.range) {
      ctx.fillStyle = 'rgba(255,200,0,0.15)';
      const a = Math.max(LEFT, toX(S.range.t0)), b = Math.min(W, toX(S.range.t1));
      ctx.fillRect(a, RULER, Math.max(1, b - a), totalH - RULER);
    }
    const byLane = new Map();
    for (const [rk, d] of S.data) for (const e of d.lanes) byLane.set(`${rk}:${e.id}`, e);
    for (const r of rows) {
      if (r.kind === 'head') {
        ctx.fillStyle = r.level === 0 ? '#dfe6ef' : '#eef1f5'; ctx.fillRect(0, r.y, r.lane ? LEFT : W, r.hgt);
        ctx.fillStyle = '#223'; ctx.font = `${r.level < 2 ? 'bold ' : ''}10px system-ui, sans-serif`;
        ctx.fillText(`${r.open ? '▾' : '▸'} ${short(r.label, Math.floor((LEFT - 16 - r.level * INDENT) / 5.6))}`, 4 + r.level * INDENT, r.y + r.hgt / 2);
        ctx.font = '10px system-ui, sans-serif';
      } else {
        ctx.fillStyle = '#444';
        ctx.fillText(short(r.label, Math.floor((LEFT - 12 - r.level * INDENT) / 5.6)), 6 + r.level * INDENT, r.y + r.hgt / 2);
      }
      if (!r.lane && r.kind !== 'counter') continue;
      ctx.save(); ctx.beginPath(); ctx.rect(LEFT, r.y, plotW(), r.hgt); ctx.clip();
      if (r.counter) drawCounter(r);
      else drawLane(r, byLane.get(`${r.rank}:${r.lane.id}`), sources);
      ctx.restore();
    }
    drawCollectives();
    drawFlows();
    drawSelection();
    ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, LEFT - 1, RULER);
    ctx.fillStyle = '#555';
    ctx.fillText(`${shown.length} rank(s) · aligned clock · ${Ls.reduce((a, L) => a + L.events, 0).toLocaleString()} events`, 4, RULER / 2);
  }

  // where a rank's lane is drawn (its own row, the row carrying it, or its collapsed ancestor)
  function placeOf(rk, laneId) {
    const r = laneRow.get(`${rk}:${laneId}`);
    if (r) return { y: r.y, hgt: r.hgt, exact: true };
    const g = hiddenRow.get(`${rk}:${laneId}`);
    if (g) return { y: g.y, hgt: g.hgt, exact: false };
    const hr = headRow.get(rk);
    return hr ? { y: hr.y, hgt: hr.hgt, exact: false } : null;
  }
  function box(rk, ref, style, lw) {
    const p = placeOf(rk, ref.lane); if (!p) return null;
    const x0 = Math.max(LEFT - 4, toX(ref.start)), x1 = Math.min(W + 4, Math.max(toX(ref.end), toX(ref.start) + 2));
    if (x1 > x0) { ctx.strokeStyle = style; ctx.lineWidth = lw; ctx.strokeRect(x0, p.y - 1, x1 - x0, p.hgt + 2); ctx.lineWidth = 1; }
    return { x: x1 > x0 ? (x0 + x1) / 2 : toX(ref.start), xs: toX(ref.start), top: p.y - 1, bottom: p.y + p.hgt + 1 };
  }
  function arrow(x0, y0, x1, y1, col) {
    ctx.strokeStyle = col; ctx.fillStyle = col; ctx.lineWidth = 1.2;
    ctx.beginPath(); ctx.moveTo(x0, y0); ctx.bezierCurveTo(x0, (y0 + y1) / 2, x1, (y0 + y1) / 2, x1, y1); ctx.stroke();
    const dir = y1 >= y0 ? 1 : -1;
    ctx.beginPath(); ctx.moveTo(x1, y1); ctx.lineTo(x1 - 3.5, y1 - 6 * dir); ctx.lineTo(x1 + 3.5, y1 - 6 * dir); ctx.closePath(); ctx.fill();
    ctx.lineWidth = 1;
  }
  const clampX = (x) => Math.min(Math.max(x, LEFT), W);

  function drawSelection() {
    const d = S.detail;
    if (!d || !d.ref) return;
    const rk = d.rank;
    if (d.op) box(rk, d.op, '#7a00cc', 2);
    const a = d.launch && box(rk, d.launch, '#d62728', 2);
    const b = box(rk, d.ref, '#000', 2);
    if (a && b) arrow(clampX(a.x), a.bottom, clampX(b.xs), b.top, '#d62728');
    for (const k of d.launched || []) { const kb = box(rk, k, '#d62728', 2); if (kb && b) arrow(clampX(b.x), b.bottom, clampX(kb.xs), kb.top, '#d62728'); }
    if (d.collective) for (const p of d.collective.ranks) if (p.event && p.rank !== rk) box(p.rank, p.event, p.rank === d.collective.last_rank ? '#d62728' : '#000', 2);
  }

  // collectives matched across the ranks shown: a line through the same collective on each rank,
  // each rank's wait for the last arrival hatched, the last arrival outlined in red
  function drawCollectives() {
    if (!S.linksOn || shown.length < 2) return;
    for (const c of S.coll) {
      const parts = c.ranks.filter((p) => p.event && LL.has(p.rank)).map((p) => ({ p, at: placeOf(p.rank, p.event.lane) })).filter((q) => q.at);
      if (parts.length < 2) continue;
      const last = c.ranks.find((p) => p.rank === c.last_rank);
      parts.sort((u, v) => u.at.y - v.at.y);
      ctx.strokeStyle = 'rgba(200,90,0,0.7)'; ctx.setLineDash([3, 2]);
      ctx.beginPath();
      parts.forEach((q, i) => { const x = clampX(toX(q.p.start)), y = q.at.y + q.at.hgt / 2; if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y); });
      ctx.stroke(); ctx.setLineDash([]);
      for (const q of parts) {
        if (last && q.p.rank !== c.last_rank && last.start > q.p.start) {
          const x0 = clampX(toX(q.p.start)), x1 = clampX(toX(last.start));
          ctx.fillStyle = 'rgba(214,39,40,0.25)'; ctx.fillRect(x0, q.at.y + q.at.hgt - 3, Math.max(1, x1 - x0), 3);
        }
        if (q.p.rank === c.last_rank) {
          const x0 = clampX(toX(q.p.start)), x1 = clampX(Math.max(toX(q.p.end), toX(q.p.start) + 2));
          ctx.strokeStyle = '#d62728'; ctx.lineWidth = 1.5; ctx.strokeRect(x0, q.at.y, x1 - x0, q.at.hgt); ctx.lineWidth = 1;
          ctx.fillStyle = '#d62728'; ctx.fillText('last', x0 + 2, q.at.y - 4);
        }
      }
    }
  }

  function drawFlows() {
    if (!S.flows) return;
    for (const [rk, f] of S.flows) {
      for (let i = 0; i < f.to_lane.length; i++) {
        const a = placeOf(rk, f.from_lane[i]), b = placeOf(rk, f.to_lane[i]);
        if (!a || !b) continue;
        const xa = toX((f.from_start[i] + f.from_end[i]) / 2), xb = toX(f.to_start[i]);
        if ((xa < LEFT && xb < LEFT) || (xa > W && xb > W)) continue;
        arrow(clampX(xa), a.y + a.hgt, clampX(xb), b.y, 'rgba(214,39,40,0.55)');
      }
    }
  }

  function drawCounter(r) {
    const c = (S.counters.get(r.rank) || {})[r.counter.id];
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
    const u = r.counter.unit;
    ctx.fillText(`max ${u === 'bytes' ? bytes(max) : u === 'B/s' ? bytes(max) + '/s' : max.toFixed(1) + (u === '%' ? '%' : '')}`, LEFT + 4, r.y + 7);
  }

  let frame = 0;
  // S.lastFrame: when the first redraw with a newly fetched window finished, and since which input
  // (performance.now() ms) -- read by bench/ui_timeline_browser.py; one small object per fetch.
  const redraw = () => { if (!frame) frame = requestAnimationFrame(() => {
    frame = 0; draw();
    if (S.fresh) { S.lastFrame = { ...S.fresh, done: performance.now() }; S.fresh = null; }
  }); };

  // ---- data ----------------------------------------------------------------------------------
  let timer = null, ctrl = null;
  function fetchWindow(delay = 25) {
    clearTimeout(timer);
    timer = setTimeout(async () => {
      if (ctrl) ctrl.abort();
      ctrl = new AbortController();
      const sig = ctrl.signal;
      const px = Math.round(plotW()), t0 = Math.floor(S.t0), t1 = Math.ceil(S.t1);
      const t = performance.now(), inputT = S.inputT;
      const jobs = [];
      for (const rk of shown) {
        const lanes = visibleLanes(rk);
        jobs.push(lanes.length ? api('timeline/window', { rank: rk, t0, t1, px, lanes: lanes.join(',') }, sig) : Promise.resolve(null));
        jobs.push(countersOpen(rk) ? api('timeline/counters', { rank: rk, t0, t1, px }, sig) : Promise.resolve({ counters: {} }));
      }
      const wantLinks = S.linksOn && shown.length >= 2;
      jobs.push(wantLinks ? api('timeline/collectives', { t0, t1, limit: 400 }, sig) : Promise.resolve({ collectives: [] }));
      const p = Promise.all(jobs);
      S.pending = p;
      try {
        const res = await p;
        S.data = new Map(); S.counters = new Map();
        let n = 0, trunc = false;
        shown.forEach((rk, i) => {
          const w = res[2 * i];
          if (w) { S.data.set(rk, w); n += w.lanes.reduce((a, e) => a + e.events.start.length, 0); trunc = trunc || w.truncated; }
          S.counters.set(rk, res[2 * i + 1].counters);
        });
        S.coll = res[res.length - 1].collectives.filter((c) => c.ranks.some((q) => LL.has(q.rank)));
        S.win = { t0, t1 }; // the range the data on screen was fetched for
        S.fetches++;
        S.lastFetchMs = performance.now() - t;
        S.fresh = { seq: S.fetches, input: inputT, fetched: performance.now(), t0, t1, events: n };
        status.textContent = `${ns(t1 - t0)} visible · ${n} events drawn${trunc ? ' (truncated)' : ''}${wantLinks ? ` · ${S.coll.length} collectives` : ''} · ${S.lastFetchMs.toFixed(0)} ms`;
        redraw();
      } catch (e) { if (e.name !== 'AbortError') status.textContent = e.message; }
      finally { if (S.pending === p) S.pending = null; }
    }, delay);
  }
  const setView = (t0, t1) => {
    const minSpan = 1000, full = end - start;
    const span = Math.max(minSpan, Math.min(t1 - t0, full * 1.2));
    const mid = (t0 + t1) / 2;
    S.t0 = mid - span / 2; S.t1 = mid + span / 2; S.inputT = performance.now();
    redraw(); fetchWindow();
  };
  const zoom = (f, at) => { const t = toT(at ?? (LEFT + plotW() / 2)); setView(t - (t - S.t0) * f, t + (S.t1 - t) * f); };
  const pan = (frac) => { const d = (S.t1 - S.t0) * frac; setView(S.t0 + d, S.t1 + d); };
  // everything the selection shows: the event, its launch and op, what it launched, and the same
  // collective on the other ranks -- so 'f' after "launched by" keeps the kernel in view
  const selectionRefs = (d) => [d.ref, d.launch, d.op, ...(d.launched || []),
    ...((d.collective && d.collective.ranks) || []).filter((p) => LL.has(p.rank)).map((p) => p)].filter(Boolean);
  const fit = () => {
    const d = S.detail;
    if (d && d.ref) {
      const refs = selectionRefs(d);
      const a = Math.min(...refs.map((r) => r.start)), b = Math.max(...refs.map((r) => r.end));
      const m = Math.max((b - a) * 0.15, 500);
      setView(a - m, b + m);
    } else if (S.range) setView(S.range.t0, S.range.t1);
    else setView(start, end);
  };

  // ---- selection and details ------------------------------------------------------------------
  async function select(rk, source, row) {
    const d = await api('timeline/event', { rank: rk, source, row });
    S.sel = { rank: rk, source, row }; S.detail = d;
    // a selected event inside a collapsed group: open the groups down to its row
    if (d.ref && !laneRow.has(`${rk}:${d.ref.lane}`)) reveal(rk, d.ref.lane);
    renderDetail(d);
    redraw();
    return d;
  }
  function reveal(rk, laneId) {
    const t = trees.find((x) => x.rank === rk);
    const path = [];
    const find = (n) => { if (n.lane) return n.lane.id === laneId; if (!n.children) return false; path.push(n); if (n.children.some(find)) return true; path.pop(); return false; };
    find(t);
    for (const n of path) open.set(n.id, true);
    persist(); layout(); resize(); fetchWindow(0);
  }
  const persist = () => sessionStorage.setItem('aiprof.tl.open', JSON.stringify(Object.fromEntries(open)));

  function refLink(label, ref, id, rk) {
    return ref ? `<div class="ref" id="${id}"><b>${label}</b> <a href="#" data-rank="${rk}" data-src="${esc(ref.source)}" data-row="${ref.row}" title="${esc(ref.name)}">${esc(elide(eventName(ref.name, ref.source), 70))}</a> <span class="hint">${ns(ref.end - ref.start)}</span></div>` : '';
  }
  function renderDetail(d) {
    const el = main.querySelector('#tl-details');
    const a = d.args || {}, r = d.ref, rk = d.rank;
    const full = r ? r.name : a.name || '';
    const clean = r ? eventName(full, r.source) : full;
    const c = d.collective;
    const coll = c ? `<details open id="tl-coll"><summary>collective ${esc(c.sig)} · group ${esc(c.pg)}${c.step >= 0 ? ' · step ' + c.step : ''}</summary>
      <div class="hint">last to arrive: <b id="tl-coll-last">rank ${c.last_rank}</b>; its lateness alone made the others wait ${us(c.caused_us)}</div>
      <table class="kv"><tr><td>rank</td><td>arrived</td><td>waited for the last</td><td>duration</td></tr>${c.ranks.map((p) => {
        const last = c.ranks.find((q) => q.rank === c.last_rank);
        return `<tr class="${p.rank === c.last_rank ? 'straggler' : ''}"><td>${p.event ? `<a href="#" data-rank="${p.rank}" data-src="${esc(p.event.source)}" data-row="${p.event.row}">rank ${p.rank}</a>` : `rank ${p.rank}`}</td><td>${ns(p.start)}</td><td>${p.rank === c.last_rank ? 'last' : ns(last.start - p.start)}</td><td>${ns(p.end - p.start)}</td></tr>`;
      }).join('')}</table></details>` : '';
    el.className = '';
    el.innerHTML = `<h4 id="tl-sel-name" title="${esc(full)}">${esc(full)}</h4>
      ${clean !== full ? `<div class="hint" id="tl-sel-short">${esc(clean)}</div>` : ''}
      <div class="hint">rank ${rk} · ${esc(r ? r.source : '')} · start ${r ? ns(r.start) : '–'} · duration ${r ? ns(r.end - r.start) : '–'}</div>
      ${refLink('launched by', d.launch, 'tl-launch', rk)}${refLink('launching op', d.op, 'tl-op', rk)}
      ${(d.launched || []).map((k) => refLink('launched', k, 'tl-launched', rk)).join('')}
      ${coll}
      ${d.stack ? `<details open><summary>host stack (${d.stack.length})</summary><ol class="stack">${d.stack.map((f) => `<li><span class="hint">${esc(f.kind)}</span> ${esc(f.name)}</li>`).join('')}</ol></details>` : ''}
      <details open><summary>fields</summary><table class="kv">${Object.entries(a).map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(String(v))}</td></tr>`).join('')}</table></details>`;
    for (const link of el.querySelectorAll('a[data-src]')) link.onclick = (e) => { e.preventDefault(); select(+link.dataset.rank, link.dataset.src, +link.dataset.row).then(fit); };
  }
  function clearSelection() {
    S.sel = null; S.detail = null; S.range = null; S.flows = null;
    const el = main.querySelector('#tl-details'); el.className = 'hint'; el.textContent = 'Select an event.';
    redraw();
  }
  async function occurrence(dir) {
    if (!S.sel) return;
    const res = await api('timeline/next', { rank: S.sel.rank, source: S.sel.source, row: S.sel.row, dir });
    if (!res.event) { status.textContent = `no ${dir > 0 ? 'next' : 'previous'} event with this name`; return; }
    await select(S.sel.rank, res.event.source, res.event.row);
    const e = res.event;
    if (e.end < S.t0 || e.start > S.t1) { const span = S.t1 - S.t0; setView(e.start - span / 2, e.start + span / 2); }
  }
  async function flows() {
    const t0 = S.range ? S.range.t0 : S.t0, t1 = S.range ? S.range.t1 : S.t1;
    const res = await Promise.all(shown.map((rk) => api('timeline/flows', { rank: rk, t0: Math.floor(t0), t1: Math.ceil(t1), limit: 2000 })));
    S.flows = new Map(shown.map((rk, i) => [rk, res[i]]));
    const n = res.reduce((a, f) => a + f.to_lane.length, 0), tot = res.reduce((a, f) => a + f.total, 0);
    status.textContent = `${n} launch → GPU flows${tot > n ? ` (first ${n} of ${tot})` : ''} in ${ns(t1 - t0)}`;
    redraw();
  }

  // ---- mouse -----------------------------------------------------------------------------------
  let drag = null;
  canvas.addEventListener('wheel', (e) => {
    if (e.shiftKey) return; // shift+wheel scrolls the tracks
    e.preventDefault();
    const r = canvas.getBoundingClientRect();
    zoom(Math.exp(e.deltaY * 0.0015), e.clientX - r.left);
  }, { passive: false });
  canvas.addEventListener('mousedown', (e) => {
    const r = canvas.getBoundingClientRect();
    drag = { x: e.clientX, t0: S.t0, t1: S.t1, moved: false, range: e.shiftKey && e.clientX - r.left > LEFT, tx: toT(e.clientX - r.left) };
    canvas.focus();
  });
  const onMove = (e) => {
    const r = canvas.getBoundingClientRect(); S.mouseX = e.clientX - r.left;
    if (!drag) return;
    const dx = e.clientX - drag.x; if (Math.abs(dx) > 2) drag.moved = true;
    if (drag.range) {
      const t = toT(e.clientX - r.left);
      S.range = { t0: Math.min(t, drag.tx), t1: Math.max(t, drag.tx) }; redraw(); return;
    }
    const dt = (dx / plotW()) * (drag.t1 - drag.t0);
    S.t0 = drag.t0 - dt; S.t1 = drag.t1 - dt; S.inputT = performance.now(); redraw(); fetchWindow();
  };
  window.addEventListener('mousemove', onMove);
  const up = (e) => {
    if (!drag) return;
    const moved = drag.moved; drag = null;
    if (moved) return;
    const r = canvas.getBoundingClientRect(), x = e.clientX - r.left, yy = e.clientY - r.top;
    const row = rows.find((q) => yy >= q.y && yy < q.y + q.hgt + GAP);
    if (!row) return;
    if (row.kind === 'head' && (x < LEFT || !row.lane)) { open.set(row.node.id, !row.open); persist(); layout(); resize(); redraw(); fetchWindow(0); return; }
    if (!row.lane || x < LEFT) return;
    const d = S.data.get(row.rank), ent = d && d.lanes.find((q) => q.id === row.lane.id);
    if (!ent) return;
    const t = toT(x), tol = (3 / plotW()) * (S.t1 - S.t0), ev = ent.events;
    let best = -1, bd = Infinity;
    for (let i = 0; i < ev.start.length; i++) {
      const dd = t < ev.start[i] ? ev.start[i] - t : t > ev.end[i] ? t - ev.end[i] : 0;
      if (dd <= tol && dd < bd) { bd = dd; best = i; }
    }
    if (best >= 0) {
      const src = sources[ev.source[best]];
      if (src === 'steps') setView(ev.start[best], ev.end[best]);
      select(row.rank, src, ev.row[best]);
    }
  };
  window.addEventListener('mouseup', up);

  // ---- keys ------------------------------------------------------------------------------------
  const onKey = (e) => {
    if (e.target.tagName === 'INPUT' || e.target.tagName === 'SELECT' || e.target.tagName === 'TEXTAREA' || e.ctrlKey || e.metaKey || e.altKey) return;
    const k = e.key;
    const at = S.mouseX != null && S.mouseX > LEFT && S.mouseX < W ? S.mouseX : undefined;
    if (k === 'w' || k === 'W' || k === 'ArrowUp') zoom(0.7, at);
    else if (k === 's' || k === 'S' || k === 'ArrowDown') zoom(1 / 0.7, at);
    else if (k === 'a' || k === 'A' || k === 'ArrowLeft') pan(-0.2);
    else if (k === 'd' || k === 'D' || k === 'ArrowRight') pan(0.2);
    else if (k === 'f' || k === 'F') fit();
    else if (k === 'n' || k === ']') occurrence(1);
    else if (k === 'N' || k === '[') occurrence(-1);
    else if (k === 'l' || k === 'L') flows();
    else if (k === 'Escape') clearSelection();
    else if (k === '/') sIn.focus();
    else return;
    e.preventDefault();
  };
  window.addEventListener('keydown', onKey);
  root.querySelector('#tl-fit').onclick = fit;
  root.querySelector('#tl-in').onclick = () => zoom(0.7);
  root.querySelector('#tl-out').onclick = () => zoom(1 / 0.7);
  root.querySelector('#tl-flows').onclick = flows;
  const links = root.querySelector('#tl-links');
  S.linksOn = links.checked;
  links.onchange = () => { S.linksOn = links.checked; fetchWindow(0); };
  root.querySelector('#tl-ranks-apply').onclick = () => {
    const pick = [...root.querySelectorAll('.tl-ranks input:checked')].map((x) => x.value);
    if (pick.length) window.__aiprof.go('timeline', { rank, ranks: pick.join(','), t0: Math.floor(S.t0), t1: Math.ceil(S.t1) });
  };

  // ---- search: Enter jumps to the next hit and selects it, Shift+Enter to the previous --------
  const sIn = root.querySelector('#tl-search');
  async function runSearch(q) {
    const res = await Promise.all(shown.map((rk) => api('timeline/search', { rank: rk, q, limit: 500 })));
    const hits = res.flatMap((x, i) => x.events.map((e) => ({ ...e, rank: shown[i] }))).sort((u, v) => u.start - v.start);
    const total = res.reduce((a, x) => a + x.total, 0);
    S.hits = { q, hits, total }; S.hit = -1;
    const box = main.querySelector('#tl-results');
    box.innerHTML = `<details id="tl-hitlist"><summary class="hint" id="tl-hits">${total} match(es)${total > hits.length ? `, first ${hits.length}` : ''} for “${esc(q)}”</summary>
      <ul class="hits">${hits.map((x, i) => `<li><a href="#" data-i="${i}" title="${esc(x.name)}">${shown.length > 1 ? `r${x.rank} · ` : ''}${ns(x.start)} · ${esc(elide(eventName(x.name, x.source), 60))}</a> <span class="hint">${esc(x.source)}</span></li>`).join('')}</ul></details>`;
    for (const a of box.querySelectorAll('a[data-i]')) a.onclick = (ev) => { ev.preventDefault(); goHit(+a.dataset.i); };
  }
  async function goHit(i) {
    const hs = S.hits.hits;
    if (!hs.length) { root.querySelector('#tl-hitpos').textContent = 'no match'; return; }
    S.hit = ((i % hs.length) + hs.length) % hs.length;
    const x = hs[S.hit];
    root.querySelector('#tl-hitpos').textContent = `${S.hit + 1} / ${hs.length}`;
    for (const li of main.querySelectorAll('#tl-results li')) li.classList.toggle('on', li.firstElementChild.dataset.i === String(S.hit));
    await select(x.rank, x.source, x.row);
    fit();
  }
  sIn.addEventListener('keydown', async (e) => {
    if (e.key === 'Escape') { sIn.blur(); canvas.focus(); return; }
    if (e.key !== 'Enter' || !sIn.value.trim()) return;
    e.preventDefault();
    const q = sIn.value.trim();
    if (!S.hits || S.hits.q !== q) { await runSearch(q); await goHit(e.shiftKey ? -1 : 0); } else await goHit(S.hit + (e.shiftKey ? -1 : 1));
  });

  layout();
  const ro = new ResizeObserver(() => { resize(); redraw(); fetchWindow(); });
  ro.observe(scroll);
  resize();
  // for tests and devtools: S.data / S.counters are Maps, so plain accessors by rank too
  window.__aiprof.timeline = { S, shown, L: (r) => LL.get(r ?? shown[0]), data: (r) => S.data.get(r ?? shown[0]) || null,
    counters: (r) => S.counters.get(r ?? shown[0]) || {}, flowsOf: (r) => (S.flows && S.flows.get(r)) || null,
    rows: () => rows.map((x) => ({ kind: x.kind, rank: x.rank, label: x.label, level: x.level, open: x.open, id: x.node?.id, lane: x.lane?.id ?? null, y: x.y, hgt: x.hgt })),
    select, fit, zoom, pan, setView, flows, occurrence, clearSelection,
    toggle: (id, v) => { open.set(id, v); persist(); layout(); resize(); redraw(); fetchWindow(0); },
    get view() { return { t0: S.t0, t1: S.t1 }; } };
  const sel = (params.get('sel') || '').split(':');
  await new Promise((res) => { const t0 = performance.now(); const poll = () => (S.data.size || performance.now() - t0 > 15000 ? res() : setTimeout(poll, 20)); fetchWindow(0); poll(); });
  if (sel.length === 3 && LL.has(+sel[0])) await select(+sel[0], sel[1], +sel[2]);
  return () => { ro.disconnect(); window.removeEventListener('keydown', onKey); window.removeEventListener('mouseup', up); window.removeEventListener('mousemove', onMove); if (ctrl) ctrl.abort(); clearTimeout(timer); delete window.__aiprof.timeline; };
}

