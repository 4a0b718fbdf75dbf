// Serving: an inference trace's iterations by phase (analysis/serving.py). Draws the report's
// numbers only: the histogram bins, the throughput series and the batch sizes come computed.
import { api } from '../api.js';
import { chart } from '../charts.js';
import { esc, us, pct, h, ms, UNKNOWN } from '../fmt.js';

const PHASE_COLOR = { prefill: '#e15759', decode: '#4e79a7', mixed: '#b07aa1', idle: '#bab0ac', unknown: '#9c755f' };

function panel(grid, id, title, note = '') {
  const el = h(`<section class="panel" id="p-${id}"><h3>${esc(title)}</h3>${note ? `<div class="hint">${note}</div>` : ''}<div class="chart" id="c-${id}"></div></section>`);
  grid.appendChild(el);
  return el.querySelector('.chart');
}

// What the tokens/s covers (analysis/serving.py rate_interval): the captured window, and the whole
// run's rate beside it where it was seen, else why not.
function tpsInterval(iv) {
  if (!iv) return 'tokens/s';
  const run = iv.whole_run_tokens_per_s != null ? `whole run ${iv.whole_run_tokens_per_s.toFixed(1)} tokens/s`
    : `whole run ${UNKNOWN}: ${esc(iv.whole_run_reason)}`;
  return `tokens/s in the ${esc(iv.covers)}: ${ms(iv.from_capture_start_us)}–${ms(iv.to_capture_start_us)} ms after its first event (${ms(iv.duration_us)} of ${ms(iv.capture_duration_us)} ms) · ${run}`;
}

export default async function serving(root, { rank }) {
  const d = await api('serving', { rank });
  const sv = d.serving;
  if (!sv || !sv.summary || !sv.summary.iterations) {
    root.innerHTML = `<div class="empty" id="serving-none">Not a serving trace: no inference iterations of a language model were found
      (steps from ${esc(d.step_source)}). Training jobs and models without a token embedding have no serving view.</div>`;
    return;
  }
  const s = sv.summary;
  const itl = s.inter_token_us;
  root.appendChild(h(`<div><h2>Serving <span class="hint">(${esc(sv.model || 'model')} · iterations from ${esc(d.step_source)}${d.step_within ? ' within ' + esc(d.step_within) : ''}${sv.shapes ? '' : ' · no input shapes: capture with --what shapes for tokens and phases'})</span></h2></div>`));
  root.appendChild(h(`<div class="kpis" id="serving-kpis">
    <div class="kpi"><b id="kpi-tps">${s.tokens_per_s.toFixed(1)}</b><span id="kpi-tps-interval">${tpsInterval(s.interval)}</span></div>
    <div class="kpi"><b id="kpi-tokens">${s.tokens_out}</b><span>tokens generated (${s.tokens_in} processed)</span></div>
    <div class="kpi"><b id="kpi-iters">${s.busy_iterations}</b><span>iterations with the model (of ${s.iterations})</span></div>
    <div class="kpi"><b id="kpi-batch">${s.batch.median}</b><span>median batch (max ${s.batch.max})</span></div>
    <div class="kpi"><b>${us(itl.p50)}</b><span>inter-token gap p50 (p90 ${us(itl.p90)}, max ${us(itl.max)})</span></div>
    <div class="kpi"><b>${pct(s.gpu_busy_pct)}</b><span>GPU busy</span></div>
    <div class="kpi"><b>${pct(s.host_overhead_pct)}</b><span>host outside the forward</span></div>
  </div>`));
  const grid = h('<div class="grid"></div>');
  root.appendChild(grid);
  const phases = Object.keys(s.by_phase);

  const edges = s.histogram.edges_us;
  const labels = edges.slice(0, -1).map((e, i) => `${us(e)}–${us(edges[i + 1])}`);
  chart(panel(grid, 'iter-hist', 'Iteration time by phase', 'iterations per duration bin, stacked by phase'), 'serving-hist', {
    tooltip: { trigger: 'axis', axisPointer: { type: 'shadow' } }, legend: { top: 0 },
    grid: { left: 50, right: 10, top: 30, bottom: 60 },
    xAxis: { type: 'category', data: labels, axisLabel: { rotate: 40, fontSize: 9 } }, yAxis: { type: 'value', minInterval: 1 },
    series: Object.entries(s.histogram.counts).map(([p, c]) => ({ name: p, type: 'bar', stack: 'n', data: c, itemStyle: { color: PHASE_COLOR[p] } })),
  });

  const tp = s.throughput;
  chart(panel(grid, 'throughput', 'Tokens/s over time', 'tokens of the iterations that ended in each bin, from the first iteration that ran the model'), 'serving-throughput', {
    tooltip: { trigger: 'axis' }, grid: { left: 60, right: 10, top: 20, bottom: 30 },
    xAxis: { type: 'category', data: tp.t_us.map((t) => us(t)) }, yAxis: { type: 'value', name: 'tokens/s' },
    series: [{ name: 'tokens/s', type: 'line', step: 'end', data: tp.tokens_per_s, showSymbol: false }],
  });

  chart(panel(grid, 'phase-share', 'Time by phase'), 'serving-share', {
    tooltip: { trigger: 'item', valueFormatter: us },
    series: [{ type: 'pie', radius: ['35%', '65%'], label: { formatter: '{b}: {d}%' },
      data: phases.map((p) => ({ name: p, value: s.by_phase[p].time_us, itemStyle: { color: PHASE_COLOR[p] } })) }],
  });

  chart(panel(grid, 'batch', 'Batch size', 'sequences sampled per iteration (prefill, decode, mixed)'), 'serving-batch', {
    tooltip: { trigger: 'axis' }, grid: { left: 50, right: 10, top: 20, bottom: 30 },
    xAxis: { type: 'category', data: s.batch.sizes.map(String), name: 'sequences' }, yAxis: { type: 'value', minInterval: 1, name: 'iterations' },
    series: [{ type: 'bar', data: s.batch.iterations }],
  });

  const rows = phases.map((p) => { const v = s.by_phase[p]; return `<tr data-phase="${esc(p)}"><td>${esc(p)}</td><td class="num">${v.iterations}</td><td class="num">${us(v.time_us)}</td>
    <td class="num">${(100 * v.share).toFixed(1)} %</td><td class="num">${us(v.median_us)}</td><td class="num">${us(v.p90_us)}</td><td class="num">${v.tokens_in}</td><td class="num">${v.tokens_out}</td></tr>`; }).join('');
  root.appendChild(h(`<section class="panel wide" id="p-phases"><h3>Phases</h3><table class="tbl" id="phase-table"><thead><tr><th>phase</th><th>iterations</th><th>time</th><th>share</th><th>median</th><th>p90</th><th>tokens in</th><th>tokens out</th></tr></thead><tbody>${rows}</tbody></table></section>`));
}
