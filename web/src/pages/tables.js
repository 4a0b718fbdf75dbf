// Kernels / ops / Python: sortable, filterable, virtualised tables (Tabulator), linked:
// click a Python function -> its ops and kernels; an op -> its kernels; a kernel -> who launched it.
import { TabulatorFull as Tabulator } from 'tabulator-tables';
import 'tabulator-tables/dist/css/tabulator_simple.min.css';
import { api } from '../api.js';
import { esc, us, short, h, kernelName, textEl } from '../fmt.js';

const num = (fmt) => ({ hozAlign: 'right', sorter: 'number', formatter: (c) => fmt(c.getValue()) });
const usCol = (title, field) => ({ title, field, ...num(us), headerFilter: false, width: 105 });
// Tabulator sets a string tooltip (and `tooltip: true`) as innerHTML: names come from the trace,
// so the tooltip is an element holding the name as text; formatters return escaped HTML.
const nameCol = { title: 'name', field: 'name', headerFilter: 'input', headerFilterPlaceholder: 'filter…', widthGrow: 4,
  tooltip: (e, c) => textEl(c.getValue()), formatter: (c) => esc(c.getValue()) };
// kernels: the cleaned name in full (wrapped, never cut), the raw name on hover
const kernelCol = { ...nameCol, cssClass: 'wrap', variableHeight: true, formatter: (c) => esc(kernelName(c.getValue())) };

export default async function tables(root, { rank }) {
  const [py, ops, ks] = await Promise.all([api('host', { rank, kind: 'python' }), api('host', { rank, kind: 'op' }), api('kernels', { rank })]);
  root.appendChild(h(`<div><h2>Kernels, ops and Python functions</h2>
    <div class="hint">Click a Python function to see the ops and kernels under it, an op to see its kernels, a kernel to see what launched it. Filter with the header boxes; sort by clicking a column.</div>
    <div id="link-box" class="linkbox hidden"></div></div>`));
  const box = root.querySelector('#link-box');
  const mk = (id, title, total, shown) => {
    const sec = h(`<section class="panel wide"><h3>${title} <span class="hint">${shown} of ${total}</span></h3><div id="${id}"></div></section>`);
    root.appendChild(sec);
    return sec.querySelector(`#${id}`);
  };
  const common = { height: '330px', layout: 'fitColumns', index: 'name', placeholder: 'no rows', selectableRows: 1 };
  const hostCols = [nameCol, { title: 'calls', field: 'calls', ...num(String), width: 80 }, usCol('inclusive', 'inclusive_us'),
    usCol('self', 'exclusive_us'), usCol('GPU launched', 'gpu_us'), usCol('GPU idle inside', 'idle_us'),
    { title: 'bottleneck', field: 'bottleneck_ratio', ...num((v) => (100 * v).toFixed(1) + ' %'), width: 100 }];
  const tPy = new Tabulator(mk('t-python', 'Python functions', py.total, py.rows.length), { ...common, data: py.rows, columns: hostCols, initialSort: [{ column: 'inclusive_us', dir: 'desc' }] });
  const tOps = new Tabulator(mk('t-ops', 'Ops', ops.total, ops.rows.length), { ...common, data: ops.rows, columns: hostCols, initialSort: [{ column: 'inclusive_us', dir: 'desc' }] });
  const tK = new Tabulator(mk('t-kernels', 'Kernels', ks.total, ks.rows.length), { ...common, data: ks.rows, initialSort: [{ column: 'total_us', dir: 'desc' }],
    columns: [kernelCol, { title: 'class', field: 'cls', headerFilter: 'input', width: 110 }, { title: 'calls', field: 'calls', ...num(String), width: 80 },
      usCol('total', 'total_us'), usCol('mean', 'mean_us'), usCol('median', 'median_us'), usCol('p95', 'p95_us'),
      { title: 'share', field: 'share_pct', ...num((v) => v.toFixed(1) + ' %'), width: 80 },
      // the GPU's PM counters during the kernel's family (server: analysis.counters), when the capture has them
      ...(ks.counters ? [
        { title: 'SM act', field: 'hw_sm_active_pct', ...num((v) => (v == null ? '' : v.toFixed(0) + ' %')), width: 80 },
        { title: 'tensor', field: 'hw_tensor_active_pct', ...num((v) => (v == null ? '' : v.toFixed(0) + ' %')), width: 80 },
        { title: 'DRAM GB/s', field: 'hw_dram_gbps', ...num((v) => (v == null ? '' : v.toFixed(0))), width: 95 },
        { title: 'bound', field: 'hw_bound', headerFilter: 'input', width: 90 }] : [])] });
  window.__aiprof.tables = { python: tPy, ops: tOps, kernels: tK };
  const ready = (t) => new Promise((res) => t.on('tableBuilt', res));
  await Promise.all([ready(tPy), ready(tOps), ready(tK)]);

  const restrict = (t, names) => { if (names) t.setFilter((row) => names.has(row.name)); else t.clearFilter(); };
  const list = (rows) => rows.slice(0, 8).map((r) => `<li><span class="num">${us(r.total_us)}</span> ${esc(short(r.name, 90))} <span class="hint">×${r.calls}</span></li>`).join('');
  const clear = () => { box.classList.add('hidden'); restrict(tOps, null); restrict(tK, null); restrict(tPy, null); };
  async function link(kind, name) {
    const l = await api('links', { rank, kind, name });
    box.classList.remove('hidden');
    if (kind === 'kernel') {
      box.innerHTML = `<b>kernel</b> <code>${esc(short(name, 100))}</code> (${l.calls} calls) is launched by <div class="two"><div><h4>ops</h4><ul>${list(l.ops)}</ul></div><div><h4>Python</h4><ul>${list(l.python)}</ul></div></div><button id="unlink">clear link</button>`;
      restrict(tOps, new Set(l.ops.map((r) => r.name)));
    } else {
      box.innerHTML = `<b>${kind}</b> <code>${esc(short(name, 100))}</code> (${l.calls} calls) — under it: <div class="two"><div><h4>ops (${l.ops.length})</h4><ul>${list(l.ops)}</ul></div><div><h4>kernels (${l.kernels.length})</h4><ul>${list(l.kernels)}</ul></div></div><button id="unlink">clear link</button>`;
      if (kind === 'python') restrict(tOps, new Set(l.ops.map((r) => r.name)));
      restrict(tK, new Set(l.kernels.map((r) => r.name)));
    }
    box.querySelector('#unlink').onclick = clear;
    window.__aiprof.lastLink = l;
  }
  tPy.on('rowClick', (e, row) => link('python', row.getData().name));
  tOps.on('rowClick', (e, row) => link('op', row.getData().name));
  tK.on('rowClick', (e, row) => link('kernel', row.getData().name));
  return () => { tPy.destroy(); tOps.destroy(); tK.destroy(); };
}
