// Dashboard: causes first (aiprof.diagnosis), then SageMaker-Profiler-like panels. Numbers come
// from /api/overview; nothing here computes a number the report does not hold.
import { api, STATIC } from '../api.js';
import { chart, PALETTE } from '../charts.js';
import { esc, us, pct, bytes, short, h, kernelLabels, UNKNOWN, deviceLabel } from '../fmt.js';

const SEV = { high: 'sev-high', medium: 'sev-medium', low: 'sev-low' };

function panel(root, id, title, note = '') {
  const el = h(`<section class="panel" id="p-${id}"><h3>${esc(title)}</h3>${note ? `<div class="hint">${note}</div>` : ''}<div class="chart" id="c-${id}"></div></section>`);
  root.appendChild(el);
  return el.querySelector('.chart');
}

function pie(el, name, data, fmt = us) {
  // ECharts draws equal slices when every value is 0 (a CPU-only capture): say so instead.
  if (!data.some((d) => d.value > 0)) {
    el.replaceWith(h('<div class="empty">Nothing measured here: no GPU activity in this capture.</div>'));
    return null;
  }
  return chart(el, name, {
    tooltip: { trigger: 'item', valueFormatter: fmt },
    legend: { bottom: 0, type: 'scroll' },
    series: [{ type: 'pie', radius: ['35%', '65%'], center: ['50%', '45%'], data,
      label: { formatter: (p) => `${p.name}\n${p.percent.toFixed(1)}%` } }],
  });
}

// A top-k bar chart of kernels plus its "other" bar: labels are the kernels' elided names (never
// cut in the middle of what tells two apart), the tooltip holds the full name.
function hbar(el, name, t, value, fmt, color) {
  const rows = t.top.map((x) => ({ full: x.name, v: value(x) }));
  const labels = kernelLabels(rows.map((r) => r.full), 56);
  if (t.other.kernels) {
    rows.push({ full: `${t.other.kernels} other kernels`, v: value(t.other), other: true });
    labels.push(`other (${t.other.kernels} kernels)`);
  }
  return chart(el, name, {
    grid: { left: 8, right: 70, top: 8, bottom: 8, containLabel: true },
    tooltip: { trigger: 'axis', axisPointer: { type: 'shadow' }, confine: true,
      extraCssText: 'max-width: 640px; white-space: normal; word-break: break-all;',
      formatter: (ps) => ps.map((p) => `${esc(rows[p.dataIndex].full)}<br><b>${fmt(p.value)}</b>`).join('') },
    xAxis: { type: 'value', axisLabel: { formatter: fmt } },
    yAxis: { type: 'category', data: labels, inverse: true, axisLabel: { fontSize: 10, overflow: 'none' } },
    series: [{ type: 'bar', data: rows.map((r) => ({ value: r.v, itemStyle: { color: r.other ? PALETTE.idle : color } })),
      label: { show: true, position: 'right', formatter: (p) => fmt(p.value), fontSize: 10 } }],
  });
}

// Causes ranked by what fixing them saves (per step and as a share of the unprofiled step), each
// with its place, remedy and the symptoms it explains; then the symptoms no cause explains.
// The text report's rule (report/text.py _marginal, ALONE_SHOWN_SHARE): a saving marginal to other
// fixes that differs from what the fix saves alone by >= 1 % of the step names those fixes and
// the stand-alone figure (a cause that pays more once others are fixed ranks by the latter).
const ALONE_SHOWN_SHARE = 0.01;
function marginalNote(sv) {
  const before = [...new Set(sv.marginal_to || [])];
  if (sv.alone_us == null || !before.length || !(sv.baseline_step_us > 0)) return '';
  if (Math.abs(sv.alone_us - sv.per_step_us) < ALONE_SHOWN_SHARE * sv.baseline_step_us) return '';
  return `once ${before.join(', ')} ${before.length === 1 ? 'is' : 'are'} fixed; ${us(sv.alone_us)} alone`;
}

function causesPanel(d) {
  const b = d.baseline || {};
  const basis = b.unprofiled_step_us
    ? `savings are per step and as a share of the ${us(b.replayed_step_us)} step replayed to match the ${us(b.unprofiled_step_us)} unprofiled step the agent measured (recorded under the profiler: ${us(b.recorded_step_us)})`
    : (b.replayed_step_us ? `savings are per step and as a share of the ${us(b.replayed_step_us)} step estimated without the profiler's cost (recorded: ${us(b.recorded_step_us)})` : '');
  const orphans = (d.symptoms || []).filter((s) => s.orphan);
  return h(`<div class="findings" id="causes">
    <h2>Causes <span class="count">${d.causes.length}</span></h2>
    ${basis ? `<div class="hint" id="causes-basis">${esc(basis)}</div>` : ''}
    ${d.causes.length ? '' : '<div class="hint" id="no-causes">No cause for this rank: no fix would save 1 % of a step.</div>'}
    ${d.all_causes > d.causes.length ? `<div class="hint" id="causes-elsewhere">${d.all_causes - d.causes.length} more on other ranks: pick one above.</div>` : ''}
    ${d.causes.map((c) => `<div class="finding cause ${SEV[c.severity] || ''}" data-code="${esc(c.code)}">
      <div class="f-head"><span class="sev">${esc(c.severity)}</span> <code>${esc(c.code)}</code>
        ${c.rank == null ? '<span class="tag">job</span>' : `<span class="tag">rank ${c.rank}</span>`}
        <span class="impact" data-saving-us="${c.saving.per_step_us}">saves ${us(c.saving.per_step_us)} per step · ${pct(100 * c.saving.share)} of the step</span>${marginalNote(c.saving) ? ` <span class="marginal">(${esc(marginalNote(c.saving))})</span>` : ''}</div>
      <div class="f-title">${esc(c.title)}</div>
      ${c.place && (c.place.site || c.place.name) ? `<div class="f-where">where: <code>${esc(short(c.place.site || c.place.name, 160))}</code>${c.place.steps && c.place.steps.length ? ` · steps ${c.place.steps.join(', ')}` : ''}</div>` : ''}
      <div class="f-why">why: ${esc(c.mechanism)}</div>
      <div class="f-sugg">fix: ${esc(c.remedy)}</div>
      ${(c.symptoms || []).length ? `<ul class="f-symptoms">${c.symptoms.map((s) => `<li data-symptom="${esc(s.code)}">explains ${us(s.explained_us / Math.max(1, (d.steps || []).length))} per step of: ${esc(s.title)}${s.rank != null ? ` (rank ${s.rank})` : ''}</li>`).join('')}</ul>` : ''}
    </div>`).join('')}
    ${orphans.length ? `<div class="orphans" id="orphans"><h3>Symptoms no cause explains</h3>${orphans.map((s) => `<div class="finding orphan" data-symptom="${esc(s.code)}">${esc(s.title)} — ${us(s.unexplained_us / Math.max(1, (d.steps || []).length))} per step unexplained: no detected mechanism accounts for it; see the hotspots and the step diff.</div>`).join('')}</div>` : ''}
  </div>`);
}

export default async function overview(root, { rank }) {
  const k0 = 15;
  const d = await api('overview', { rank, k: k0 });
  const s = d.summary || {};
  root.appendChild(causesPanel(d));
  // the first annotation histogram is fetched while the charts are drawn
  const firstAnn = d.annotations.length && !STATIC ? api('annotation', { rank, name: d.annotations[0].name, bins: 15 }) : null;
  const ks = d.kernels, fl = d.flops || {};
  // unknown is "—" with the report's reason (analysis.flops), never 0
  const mfu = fl.mfu_pct != null ? pct(fl.mfu_pct) : UNKNOWN;
  const mfuNote = fl.mfu_pct != null
    ? `MFU (median step, ${esc(fl.precision)} peak ${fl.peak_tflops} TFLOP/s${fl.source === 'shapes' ? ', FLOPs estimated from shapes' : ''})`
    : `MFU: ${esc(fl.mfu_reason || 'unknown')}${fl.tflops_per_s != null ? ` (${fl.tflops_per_s.toFixed(1)} TFLOP/s)` : ''}`;
  const cpuOnly = d.device.kind === 'cpu';
  root.appendChild(h(`<div class="kpis" id="kpis">
    <div class="kpi"><b id="kpi-steps">${s.steps ?? 0}</b><span>steps (${esc(d.step_source)})</span></div>
    <div class="kpi"><b id="kpi-median">${us(s.step_median_us)}</b><span>median step</span></div>
    <div class="kpi"><b id="kpi-max">${us(s.step_max_us)}</b><span>slowest step</span></div>
    <div class="kpi"><b id="kpi-busy">${cpuOnly ? UNKNOWN : pct(d.gpu.busy_pct)}</b><span>GPU busy, in steps${cpuOnly ? ' (CPU only: no GPU)' : ''}</span></div>
    <div class="kpi"><b id="kpi-mfu">${mfu}</b><span id="kpi-mfu-note">${mfuNote}</span></div>
    <div class="kpi"><b id="kpi-sync">${us(s.sync_us)}</b><span>host blocked in sync calls, in steps</span></div>
    <div class="kpi"><b id="kpi-launches">${ks.launches}</b><span>kernel launches, whole trace (<span id="kpi-distinct">${ks.distinct}</span> distinct)</span></div>
    <div class="kpi"><b id="kpi-ktime">${us(ks.total_us)}</b><span>GPU kernel time, whole trace</span></div>
    <div class="kpi"><b id="kpi-device">${esc(deviceLabel(d.device))}</b><span>rank ${d.rank}${d.host ? ' · ' + esc(d.host) : ''}</span></div>
  </div>`));
  const grid = h('<div class="grid"></div>');
  root.appendChild(grid);
  const winMs = (d.window.end_ns - d.window.start_ns) / 1e6;

  pie(panel(grid, 'gpu-active', 'GPU active vs idle (in steps)', `over the ${s.steps ?? 0} steps: ${us(s.duration_us)}`), 'gpu-active', [
    { name: 'active', value: d.gpu.busy_us, itemStyle: { color: PALETTE.busy } },
    { name: 'idle', value: d.gpu.idle_us, itemStyle: { color: PALETTE.idle } }]);

  // CPU active vs idle: time-weighted means over the capture window, computed by
  // analysis.timeseries.cpu_active_idle from the agent's host samples
  const ca = d.hw.cpu_active;
  if (ca) {
    const win = (ca.window_ns[1] - ca.window_ns[0]) / 1e6, cov = ca.covered_ns / 1e6;
    pie(panel(grid, 'cpu-active', 'CPU active vs idle (host, all CPUs)',
      `time-weighted mean over the capture window (${cov.toFixed(0)} of ${win.toFixed(0)} ms covered by samples)` +
      (ca.process_cpu_pct != null ? ` · this process: <b id="cpu-proc">${ca.process_cpu_pct.toFixed(1)} %</b> of one CPU` : '')),
    'cpu-active', [
      { name: 'active', value: ca.active_pct, itemStyle: { color: PALETTE.busy } },
      { name: 'idle', value: ca.idle_pct, itemStyle: { color: PALETTE.idle } }], (v) => `${v.toFixed(1)} %`);
  } else {
    grid.appendChild(h('<section class="panel" id="p-cpu-active"><h3>CPU active vs idle</h3><div class="empty" id="cpu-active-none">CPU activity was not captured (no host samples in <code>hw.csv</code> for this rank). Capture with <code>aiprof run --what kernels,hw</code> to record it.</div></section>'));
  }

  // GPU utilisation over time: exact busy share from the trace per rank (grouped by node), and
  // the sampled NVML utilisation per GPU when the capture has hw.csv; every rank on the aligned
  // clock, in ms after this rank's window start.
  const hasHw = d.hw.gpu_util.length > 0;
  const elU = panel(grid, 'gpu-util', 'GPU utilisation over time (%)',
    (hasHw ? 'trace: busy share per bin, per rank by node · NVML: sampled per GPU (a gap: not sampled, as while the PM counters run)'
      : d.hw.file ? 'busy share per bin, from the trace. <b class="nohw">No GPU samples in this capture\'s hw.csv</b> (NVML was not available where it ran).'
        : 'busy share per bin, from the trace. <b class="nohw">No hardware samples (hw.csv) in this capture</b>: per-GPU NVML utilisation is shown only for captures made with <code>aiprof run/attach</code>.'));
  const o = d.window.start_ns;
  const series = d.gpu_util.map((u) => ({ name: `${u.host} rank ${u.rank} (trace)`, type: 'line', showSymbol: false, step: 'end', // a bin's value holds from its start
    data: u.busy_pct.map((v, i) => [(u.start_ns + (u.offset_ns || 0) - o + i * u.bin_ns) / 1e6, v]) }));
  for (const x of d.hw.gpu_util) series.push({ name: `${x.host} rank ${x.rank} ${x.device} (NVML)`, type: 'line', showSymbol: false, step: 'start', lineStyle: { type: 'dashed' },
    data: x.ts.map((t, i) => [(t + (x.offset_ns || 0) - o) / 1e6, x.value[i]]) });
  chart(elU, 'gpu-util', { tooltip: { trigger: 'axis', valueFormatter: (v) => (typeof v === 'number' ? `${v.toFixed(1)} %` : 'not sampled') }, legend: { bottom: 0, type: 'scroll' },
    grid: { left: 45, right: 15, top: 10, bottom: 50 },
    xAxis: { type: 'value', name: 'ms', nameLocation: 'end', min: 0, max: Math.ceil(winMs) },
    yAxis: { type: 'value', min: 0, max: 100, name: '%' }, series });

  // CPU utilisation over time: the host's share of all CPUs (0-100 %) and this process's use in % of
  // one CPU (can pass 100 %) are different units: each on its own axis, named.
  const elC = panel(grid, 'cpu', 'CPU utilisation over time', d.hw.cpu.length ? 'left: host, % of all CPUs · right: this process, % of one CPU · ms after the window start' : '');
  if (d.hw.cpu.length) {
    const sys = d.hw.cpu.filter((x) => x.metric === 'cpu_util_pct'), proc = d.hw.cpu.filter((x) => x.metric !== 'cpu_util_pct');
    chart(elC, 'cpu', { tooltip: { trigger: 'axis', valueFormatter: (v) => `${v.toFixed(1)} %` }, legend: { bottom: 0 }, grid: { left: 50, right: 55, top: 24, bottom: 50 },
      xAxis: { type: 'value', name: 'ms', min: 0, max: Math.ceil(winMs) },
      yAxis: [{ type: 'value', name: '% of all CPUs', min: 0, max: 100 }, { type: 'value', name: '% of one CPU', min: 0, splitLine: { show: false } }],
      series: [...sys.map((x) => ({ name: `${d.host || x.device}: host CPU (% of all CPUs)`, yAxisIndex: 0, type: 'line', showSymbol: false, step: 'start', // a sample covers the period before it
        data: x.ts.map((t, i) => [(t - o) / 1e6, x.value[i]]) })),
      ...proc.map((x) => ({ name: 'this process (% of one CPU)', yAxisIndex: 1, type: 'line', showSymbol: false, step: 'start', lineStyle: { type: 'dashed' },
        data: x.ts.map((t, i) => [(t - o) / 1e6, x.value[i]]) }))] });
  } else {
    elC.replaceWith(h('<div class="empty" id="cpu-none">CPU utilisation was not captured (no <code>hw.csv</code> beside this trace). Capture with <code>aiprof run</code> to record it.</div>'));
  }

  // top-k kernels by time and, separately, by launches (k adjustable), each with an "other" bar
  const kp = h(`<section class="panel wide" id="p-kernels"><h3>GPU kernels, whole trace: time and launches
      <label class="k">top <input id="topk" type="number" min="1" max="200" value="${ks.k}"></label></h3>
      <div class="hint" id="kernels-all">all kernels: ${us(ks.total_us)} in ${ks.launches} launches, ${ks.distinct} distinct · each chart has its own top k; grey: all the other kernels</div>
      <h4>by time</h4><div class="chart tall" id="c-kernel-time"></div><h4>by launches</h4><div class="chart tall" id="c-kernel-calls"></div></section>`);
  grid.appendChild(kp);
  const drawKernels = (kk) => {
    const tall = `${Math.max(380, 60 + 22 * (kk.by_time.top.length + 1))}px`;
    for (const id of ['#c-kernel-time', '#c-kernel-calls']) kp.querySelector(id).style.height = tall;
    hbar(kp.querySelector('#c-kernel-time'), 'kernel-time', kk.by_time, (x) => x.total_us, us, PALETTE.compute);
    hbar(kp.querySelector('#c-kernel-calls'), 'kernel-calls', kk.by_calls, (x) => x.calls, (v) => String(v), '#76b7b2');
  };
  drawKernels(ks);
  kp.querySelector('#topk').addEventListener('change', async (e) => {
    if (STATIC) return;
    const k = Math.max(1, Math.min(200, +e.target.value || 15));
    const dd = await api('overview', { rank, k });
    drawKernels(dd.kernels);
  });

  const hist = d.step_hist;
  chart(panel(grid, 'step-hist', 'Step duration histogram', `${s.steps ?? 0} steps; bins in ms`), 'step-hist', {
    tooltip: { trigger: 'axis' }, grid: { left: 40, right: 10, top: 10, bottom: 40 },
    xAxis: { type: 'category', data: hist.counts.map((_, i) => `${(hist.edges[i] / 1e3).toFixed(1)}–${(hist.edges[i + 1] / 1e3).toFixed(1)}`), name: 'ms', axisLabel: { rotate: 30, fontSize: 9 } },
    yAxis: { type: 'value', minInterval: 1, name: 'steps' },
    series: [{ type: 'bar', data: hist.counts, itemStyle: { color: PALETTE.compute } }] });

  const src = d.precision_source_us || {};
  pie(panel(grid, 'precision', 'Kernel precision (all kernel time, whole trace)',
    `from the launching op's input dtypes (${us(src['op dtype'] || 0)}) and kernel names (${us(src.name || 0)}); unknown: ${us(src.unknown || 0)}`), 'precision',
  Object.entries(d.precision_us).map(([name, value]) => ({ name, value })));
  pie(panel(grid, 'activity', 'GPU activity (time, whole trace)', 'summed durations; host waits in sync calls are not GPU work (see the KPI above)'), 'activity',
    Object.entries(d.activity).map(([name, x]) => ({ name: `${name} (${x.count})`, value: x.time_us })));
  const elM = panel(grid, 'memops', 'GPU memory operations (time, whole trace)');
  if (d.memops.length) pie(elM, 'memops', d.memops.map((m) => ({ name: `${m.name} ×${m.count} · ${bytes(m.bytes)}`, value: m.time_us })));
  else elM.replaceWith(h('<div class="empty">No memcpy/memset in this trace.</div>'));

  // histograms of custom annotations (record_function), chosen by the user
  const ap = h(`<section class="panel" id="p-annotation"><h3>Annotation durations
      <select id="ann">${d.annotations.map((a) => `<option value="${esc(a.name)}">${esc(short(a.name, 50))} (${a.calls})</option>`).join('')}</select></h3>
      <div class="chart" id="c-annotation"></div></section>`);
  grid.appendChild(ap);
  const drawAnn = async (name) => {
    const el = ap.querySelector('#c-annotation');
    if (!name) { el.innerHTML = '<div class="empty">No record_function annotations in this trace.</div>'; return; }
    const a = await (firstAnn && name === d.annotations[0].name ? firstAnn : api('annotation', { rank, name, bins: 15 }));
    chart(el, 'annotation', { tooltip: { trigger: 'axis' }, grid: { left: 40, right: 10, top: 10, bottom: 40 },
      xAxis: { type: 'category', data: a.counts.map((_, i) => (a.edges[i] / 1e3).toFixed(2)), name: 'ms', axisLabel: { fontSize: 9 } },
      yAxis: { type: 'value', minInterval: 1, name: 'calls' }, series: [{ type: 'bar', data: a.counts, itemStyle: { color: '#af7aa1' } }] });
  };
  const sel = ap.querySelector('#ann');
  sel.addEventListener('change', () => drawAnn(sel.value));
  await drawAnn(d.annotations.length ? d.annotations[0].name : null);
}
