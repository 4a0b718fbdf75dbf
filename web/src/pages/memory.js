// Memory: CUDA allocated/reserved over time, peak, top allocation sites (trace and/or snapshot).
import { api } from '../api.js';
import { chart, PALETTE } from '../charts.js';
import { esc, bytes, ns, short, h } from '../fmt.js';

function sites(title, id, rows) {
  return `<section class="panel"><h3>${esc(title)}</h3><table class="tbl" id="${id}"><thead><tr><th>where</th><th>allocations</th><th>bytes</th></tr></thead><tbody>
    ${rows.map((r) => `<tr><td title="${esc(r.where)}">${esc(short(r.where, 90))}</td><td class="num">${r.calls ?? ''}</td><td class="num">${bytes(r.bytes)}</td></tr>`).join('')}</tbody></table></section>`;
}

export default async function memory(root, { rank }) {
  const d = await api('memory', { rank });
  const m = d.memory;
  root.appendChild(h(`<div class="kpis"><div class="kpi"><b id="mem-peak">${bytes(m.peak_allocated_bytes)}</b><span>peak allocated${m.peak_step != null ? ' (step ' + m.peak_step + ')' : ''}</span></div>
    <div class="kpi"><b>${bytes(m.peak_reserved_bytes)}</b><span>peak reserved</span></div>
    <div class="kpi"><b>${bytes(d.device_memory_bytes)}</b><span>device memory</span></div>
    <div class="kpi"><b>${esc(m.source)}</b><span>source</span></div></div>`));
  const names = Object.keys(d.series);
  if (names.length) {
    const el = h('<div class="chart tall" id="c-memory"></div>');
    root.appendChild(el);
    chart(el, 'memory', {
      tooltip: { trigger: 'axis', valueFormatter: bytes }, legend: { top: 0 }, grid: { left: 80, right: 20, top: 30, bottom: 40 },
      xAxis: { type: 'value', name: 'ms', min: Math.floor(d.window.start / 1e6), max: Math.ceil(d.window.end / 1e6), axisLabel: { formatter: (v) => v.toFixed(0) } },
      yAxis: { type: 'value', axisLabel: { formatter: bytes } },
      series: names.map((k, i) => ({ name: k, type: 'line', step: 'end', showSymbol: false, areaStyle: i ? undefined : { opacity: 0.15 },
        itemStyle: { color: i ? PALETTE.communication : PALETTE.compute },
        data: d.series[k].ts.map((t, j) => [t / 1e6, d.series[k].value[j]]),
        markArea: i ? undefined : { silent: true, itemStyle: { color: 'rgba(0,0,0,0.04)' }, data: d.steps.map((s) => [{ xAxis: s.start / 1e6, name: 'step ' + s.step }, { xAxis: s.end / 1e6 }]) },
        markLine: i || m.peak_allocated_bytes == null ? undefined : { symbol: 'none', data: [{ yAxis: m.peak_allocated_bytes, name: 'peak' }], label: { formatter: (p) => 'peak ' + bytes(p.value) } } })),
    });
  } else {
    root.appendChild(h(`<div class="empty" id="no-memory">This trace has no memory events (capture with <code>profile_memory=True</code>, or <code>aiprof run --what memory</code>), so there is no allocated/reserved curve${d.hw.length ? ': the NVML samples below show the GPU\'s used memory' : ''}.</div>`));
  }
  // NVML samples of hw.csv (written by `aiprof run/attach --what hw`): the GPU's used memory as the
  // driver sees it (every process, the CUDA context and the caching allocator's reserve included),
  // and the host's used memory and this process's RSS
  if (d.hw.length) {
    root.appendChild(h(`<div class="kpis small" id="nvml-kpis">${d.hw.map((x) => `<div class="kpi"><b data-series="${esc(x.label)}">${bytes(x.peak_bytes)}</b><span>peak ${esc(x.label)} (${x.device.startsWith('gpu') ? 'NVML' : 'host'}, ${x.samples} samples)</span></div>`).join('')}</div>`));
    const el = h('<div class="chart" id="c-memory-hw"></div>');
    root.appendChild(el);
    chart(el, 'memory-hw', {
      tooltip: { trigger: 'axis', valueFormatter: bytes }, legend: { top: 0, type: 'scroll' }, grid: { left: 80, right: 20, top: 30, bottom: 40 },
      xAxis: { type: 'value', name: 'ms', min: Math.floor(d.window.start / 1e6), max: Math.ceil(d.window.end / 1e6), axisLabel: { formatter: (v) => v.toFixed(0) } },
      yAxis: { type: 'value', axisLabel: { formatter: bytes } },
      series: d.hw.map((x) => ({ name: `${x.label}${x.device.startsWith('gpu') ? ' (NVML)' : ''}`, type: 'line', step: 'end', showSymbol: false,
        lineStyle: x.device.startsWith('gpu') ? undefined : { type: 'dashed' },
        data: x.ts.map((t, j) => [t / 1e6, x.value[j]]) })),
    });
  } else {
    root.appendChild(h('<div class="empty" id="no-nvml">No NVML memory samples: this capture has no <code>hw.csv</code> with <code>mem_used_bytes</code> (capture with <code>aiprof run --what kernels,hw</code>).</div>'));
  }
  const grid = h('<div class="grid"></div>');
  root.appendChild(grid);
  if (m.top_allocators?.length) grid.appendChild(h(sites('Top allocating ops (trace)', 'alloc-trace', m.top_allocators)));
  if (d.snapshot) {
    grid.appendChild(h(sites(`Top allocation sites (snapshot ${d.snapshot.file.split('/').pop()}, peak ${bytes(d.snapshot.peak_allocated_bytes)})`, 'alloc-snap', d.snapshot.top_allocators)));
  } else {
    grid.appendChild(h('<div class="empty">No CUDA memory snapshot given (<code>aiprof ui --memory-snapshot FILE</code>, a <code>torch.cuda.memory._snapshot()</code> pickle).</div>'));
  }
  void ns;
}
