import './style.css';
import { api, STATIC } from './api.js';
import { disposeAll } from './charts.js';
import { esc, kernelName, elide, kernelLabels, deviceLabel } from './fmt.js';
import overview from './pages/overview.js';
import steps from './pages/steps.js';
import ranks from './pages/ranks.js';
import timeline from './pages/timeline.js';
import flame from './pages/flame.js';
import memory from './pages/memory.js';
import serving from './pages/serving.js';

const PAGES = [
  ['overview', 'Overview', overview], ['steps', 'Steps', steps], ['tables', 'Kernels / ops / Python', (...a) => import('./pages/tables.js').then((m) => m.default(...a))],
  ['ranks', 'Ranks', ranks], ['timeline', 'Timeline', timeline], ['flame', 'Flame graph', flame], ['memory', 'Memory', memory],
  ['serving', 'Serving', serving],
];

const state = { meta: null, rank: 0, cleanup: null };
window.__aiprof = window.__aiprof || { charts: {} };
window.__aiprof.state = state;
window.__aiprof.fmt = { kernelName, elide, kernelLabels }; // name formatting, for tests and devtools

export function route() {
  const [name, qs] = (location.hash.replace(/^#\/?/, '') || 'overview').split('?');
  return { name, params: new URLSearchParams(qs || '') };
}

export function go(name, params = {}) {
  const q = new URLSearchParams(params).toString();
  location.hash = `#/${name}${q ? '?' + q : ''}`;
}
window.__aiprof.go = go;

async function render() {
  const { name, params } = route();
  const page = PAGES.find((p) => p[0] === name) || PAGES[0];
  if (params.has('rank')) state.rank = +params.get('rank');
  document.getElementById('rank').value = String(state.rank);
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('on', a.dataset.page === page[0]);
  if (state.cleanup) { try { state.cleanup(); } catch (e) { /* page already gone */ } state.cleanup = null; }
  disposeAll();
  const root = document.getElementById('page');
  root.innerHTML = '';
  root.dataset.page = page[0];
  root.removeAttribute('data-ready');
  if (STATIC && page[0] !== 'overview') {
    root.innerHTML = `<div class="note">This static report holds the overview only. Run <code>aiprof ui ${esc(state.meta.ranks.map((r) => r.source).join(' '))}</code> for the other pages.</div>`;
    root.dataset.ready = 'static';
    return;
  }
  try {
    state.cleanup = (await page[2](root, { rank: state.rank, meta: state.meta, params, go })) || null;
    root.dataset.ready = '1';
    window.__aiprof.readyAt = performance.now(); // ms after navigation start: read by bench/ui_timeline_browser.py
  } catch (e) {
    root.innerHTML = `<div class="error">${esc(e.message)}</div>`;
    root.dataset.ready = 'error';
  }
}

async function boot() {
  state.meta = await api('meta');
  const nav = document.getElementById('nav');
  nav.innerHTML = PAGES.map(([id, label]) => `<a href="#/${id}" data-page="${id}" class="${STATIC && id !== 'overview' ? 'off' : ''}">${label}</a>`).join('');
  const sel = document.getElementById('rank');
  sel.innerHTML = state.meta.ranks.map((r) => `<option value="${r.rank}">${r.rank}${r.host ? ' · ' + esc(r.host) : ''}</option>`).join('');
  state.rank = state.meta.ranks[0].rank;
  sel.addEventListener('change', () => {
    state.rank = +sel.value;
    const { name, params } = route();
    params.set('rank', sel.value);
    params.delete('t0'); params.delete('t1');
    go(name, Object.fromEntries(params));
  });
  const r0 = state.meta.ranks[0];
  document.getElementById('capture-info').textContent =
    `${state.meta.ranks.length} rank(s) · ${deviceLabel(r0.device)} · ${r0.source.split('/').pop()}${STATIC ? ' · static report' : ''}`;
  window.addEventListener('hashchange', render);
  await render();
}

boot().catch((e) => {
  document.getElementById('page').innerHTML = `<div class="error">could not load: ${esc(e.message)}</div>`;
});
