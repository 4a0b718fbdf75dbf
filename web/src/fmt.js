// Formatting only: every number comes from the server's analyses.
export const esc = (s) => String(s ?? '').replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));

export function us(v) {
  if (v === null || v === undefined) return '–';
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(2) + ' s';
  if (a >= 1e3) return (v / 1e3).toFixed(2) + ' ms';
  return v.toFixed(1) + ' µs';
}
export const ns = (v) => us(v / 1000);
export const ms = (v) => (v / 1000).toFixed(2);
export const pct = (v) => (v === null || v === undefined ? '–' : v.toFixed(1) + ' %');

export function bytes(v) {
  if (v === null || v === undefined) return '–';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0, x = Math.abs(v);
  while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
  return (v < 0 ? '-' : '') + x.toFixed(i ? 2 : 0) + ' ' + u[i];
}

// A figure the capture cannot give (the report says why beside it): never shown as 0.
export const UNKNOWN = '—';
// report/text.py device_label(): the GPU's model, "CPU only" for a capture with no GPU.
export const deviceLabel = (dev) => (dev.kind === 'cpu' ? 'CPU only' : dev.name || 'GPU (model not recorded)');

export const short = (s, n = 70) => (s && s.length > n ? s.slice(0, n - 1) + '…' : s || '');

// An element holding s as text: for APIs that set a string as innerHTML (Tabulator's tooltips), so
// a name from a trace is never parsed as markup.
export function textEl(s, tag = 'div') {
  const el = document.createElement(tag);
  el.textContent = String(s ?? '');
  return el;
}

export function h(html) {
  const t = document.createElement('template');
  t.innerHTML = html.trim();
  return t.content.firstElementChild;
}

// ---- kernel names: shortened without losing what tells two kernels apart -------------------
// The parameter list (its types repeat the template's), the return type, namespaces, operator()
// wrappers and ATen's launch boilerplate (std::array of pointers, offset calculators, load/store
// casts) say nothing about which kernel it is; the template arguments and tile shapes do.
const NOISE = [
  /,\s*(?:std::)?array<char\*, \d+ul>/g,
  /,\s*(?:Trivial)?OffsetCalculator<\d+, unsigned int(?:, (?:true|false))?>/g,
  /,\s*(?:LoadWithCast|StoreWithCast|LoadWithoutCast|StoreWithoutCast)(?:<\d+>)?/g,
  /::operator\(\)\(\) const/g,
];

function stripParams(n) {
  let depth = 0;
  for (let i = 0; i < n.length; i++) {
    const c = n[i];
    if (c === '<') depth++;
    else if (c === '>') depth = Math.max(0, depth - 1);
    else if (c === '(' && depth === 0 && i > 0) return n.slice(0, i);
  }
  return n;
}

// A kernel's name without the noise above: "void at::native::vectorized_elementwise_kernel<4,
// at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, ...)" -> "vectorized_elementwise_
// kernel<4, CUDAFunctor_add<float>>". Names that are not C++ (nvjet_*, Python frames) stay as they are.
export function kernelName(s) {
  let n = String(s ?? '');
  if (/\.py\(\d+\)/.test(n)) return n;
  if (!/[<:]|^void /.test(n)) return n.split('_').filter((p, i) => i === 0 || !NOISE_PARTS.has(p)).join('_');
  n = n.replace(/^void /, '').replace(/\(anonymous namespace\)::/g, '');
  n = stripParams(n);
  n = n.replace(/\{lambda\(([^()]*)\)#(\d+)\}/g, 'λ($1)#$2');
  n = n.replace(/(?:\b[A-Za-z_]\w*::)+(?=[A-Za-z_~])/g, '');
  n = n.replace(/\(([^()]*)\)(?=::)/g, '()');
  for (const re of NOISE) n = n.replace(re, '');
  n = n.replace(/\s+>/g, '>').replace(/\s+/g, ' ').trim();
  const wrap = n.match(/^(?:Kernel2?|device_kernel)<([^,]+)>$/); // cutlass::Kernel2<the real kernel>
  if (wrap) n = wrap[1];
  // generated library names (cuDNN): parts that every such kernel carries
  if (!n.includes('<')) n = n.split('_').filter((p, i) => i === 0 || !NOISE_PARTS.has(p)).join('_');
  return n;
}
const NOISE_PARTS = new Set(['generated', 'fort', 'native', 'kernel0', 'cga1x1x1']);

// At most n characters, never cut in the middle of what distinguishes: a templated name keeps its
// head and the tail of its arguments ("unrolled_elementwise_kernel<…CUDAFunctor_add<float>>"); a
// name_with_parts keeps its first part and as many trailing parts as fit ("cutlass_…_64x64_64x4_tn").
export function elide(s, n = 56) {
  s = String(s ?? '');
  if (s.length <= n) return s;
  const lt = s.indexOf('<');
  if (lt > 0 && lt <= n - 12) {
    // the tail starts at a token: a few characters more rather than half an identifier
    let from = s.length - (n - lt - 2);
    const back = s.slice(lt + 1, from).search(/[ ,<(][^ ,<(]*$/);
    if (back >= 0 && from - (lt + 1 + back) <= 16) from = lt + 2 + back;
    return s.slice(0, lt + 1) + '…' + s.slice(from).trimStart();
  }
  const parts = s.split('_');
  if (parts.length > 2 && parts[0].length < n / 2) {
    const tail = [];
    let len = parts[0].length + 3;
    for (let i = parts.length - 1; i > 0; i--) {
      if (len + parts[i].length + 1 > n) break;
      tail.unshift(parts[i]);
      len += parts[i].length + 1;
    }
    if (tail.length) return parts[0] + '_…_' + tail.join('_');
  }
  return '…' + s.slice(s.length - n + 1);
}

// Labels for names shown together (a chart's bars): each elided kernel name, lengthened where two
// different kernels would otherwise read the same, until they differ (or are shown in full).
export function kernelLabels(names, n = 56) {
  const clean = names.map(kernelName);
  const width = names.map(() => n);
  const label = (i) => {
    if (width[i] < clean[i].length) return elide(clean[i], width[i]);
    return width[i] < clean[i].length + 200 ? clean[i] : names[i];
  };
  for (let round = 0; round < 40; round++) {
    const out = names.map((_, i) => label(i));
    const seen = new Map();
    out.forEach((l, i) => { if (!seen.has(l)) seen.set(l, []); seen.get(l).push(i); });
    let changed = false;
    for (const idx of seen.values()) {
      if (new Set(idx.map((i) => names[i])).size < 2) continue;
      for (const i of idx) { width[i] += width[i] < clean[i].length ? 16 : 200; changed = true; }
    }
    if (!changed) return out;
  }
  return names.slice();
}

// one event label on the timeline: kernels get the cleaned name, everything else as it is
export const eventName = (s, source) => (source === 'kernels' ? kernelName(s) : String(s ?? ''));
