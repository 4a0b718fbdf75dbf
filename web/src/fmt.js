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

export const short = (s, n = 70) => (s && s.length > n ? s.slice(0, n - 1) + '…' : s || '');

export function h(html) {
  const t = document.createElement('template');
  t.innerHTML = html.trim();
  return t.content.firstElementChild;
}

// keep both ends of long kernel names (their start and their tile/shape suffix both matter)
export const mid = (s, n = 44) => (s && s.length > n ? s.slice(0, Math.ceil(n * 0.55)) + '…' + s.slice(s.length - Math.floor(n * 0.45) + 1) : s || '');
