// Steps: stacked breakdown per step; pick two steps (chart bars or the chips) -> step diff.
import { api } from '../api.js';
import { chart, PALETTE } from '../charts.js';
import { esc, us, pct, short, h } from '../fmt.js';

const PARTS = [['compute_us', 'compute'], ['communication_us', 'communication'], ['memory_us', 'memory'], ['idle_us', 'idle']];

export default async function steps(root, { rank, go }) {
  const d = await api('steps', { rank });
  if (!d.steps.length) { root.innerHTML = '<div class="empty">No steps found in this trace.</div>'; return; }
  root.appendChild(h(`<div><h2>Steps <span class="hint">(${esc(d.step_source)}; exposed time: each instant counted once, compute first)</span></h2>
    <div class="hint">Click two steps (bars or buttons) to diff them: the first is the base.</div></div>`));
  const el = h('<div class="chart tall" id="c-steps"></div>');
  root.appendChild(el);
  const chips = h(`<div class="chips" id="step-chips">${d.steps.map((s) => `<button class="chip" data-step="${s.step}">step ${s.step} · ${us(s.duration_us)}</button>`).join('')}</div>`);
  root.appendChild(chips);
  const diffBox = h('<div id="diff"></div>');
  const slider = h(`<section class="panel" id="slider-box"><h3>Step <input type="range" id="step-slider" min="0" max="${d.steps.length - 1}" value="0"> <span id="slider-label"></span></h3><div id="step-detail"></div></section>`);
  root.appendChild(slider);
  root.appendChild(diffBox);

  const picked = [];
  const c = chart(el, 'steps', {
    tooltip: { trigger: 'axis', axisPointer: { type: 'shadow' }, valueFormatter: us },
    legend: { top: 0 }, grid: { left: 60, right: 20, top: 30, bottom: 30 },
    xAxis: { type: 'category', data: d.steps.map((s) => `step ${s.step}`) },
    yAxis: { type: 'value', axisLabel: { formatter: (v) => (v / 1000) + ' ms' } },
    series: PARTS.map(([k, name]) => ({ name, type: 'bar', stack: 't', data: d.steps.map((s) => s[k]), itemStyle: { color: PALETTE[name] } })),
  });
  const mark = () => {
    for (const b of chips.querySelectorAll('.chip')) b.classList.toggle('on', picked.includes(+b.dataset.step));
    c.setOption({ xAxis: { axisLabel: { color: (v) => (picked.includes(+v.split(' ')[1]) ? '#c00' : '#333') } } });
  };
  async function pick(step) {
    if (picked.includes(step)) picked.splice(picked.indexOf(step), 1); else picked.push(step);
    if (picked.length > 2) picked.splice(0, picked.length - 1);
    mark();
    if (picked.length === 2) await showDiff(picked[0], picked[1]);
  }
  c.on('click', (p) => pick(d.steps[p.dataIndex].step));
  chips.addEventListener('click', (e) => { const b = e.target.closest('.chip'); if (b) pick(+b.dataset.step); });

  async function showDiff(base, compare) {
    diffBox.innerHTML = '<div class="hint">computing diff…</div>';
    const x = await api('diff', { rank, base, compare });
    const rows = (items) => items.map((i) => `<tr><td>${esc(i.kind)}</td><td title="${esc(i.name)}">${esc(short(i.name, 90))}${i.site ? `<div class="hint">${esc(i.site)}</div>` : ''}</td>
      <td class="num ${i.delta_us > 0 ? 'worse' : 'better'}">${i.delta_us > 0 ? '+' : ''}${us(i.delta_us)}</td>
      <td class="num">${i.delta_calls > 0 ? '+' : ''}${i.delta_calls}</td><td class="num">${us(i.base_us)}</td><td class="num">${us(i.compare_us)}</td></tr>`).join('');
    diffBox.innerHTML = `<section class="panel wide" id="diff-panel"><h3>Step diff: step ${x.base.step} (${us(x.base.duration_us)}) → step ${x.compare.step} (${us(x.compare.duration_us)}):
      <span class="${x.delta_us > 0 ? 'worse' : 'better'}" id="diff-delta">${x.delta_us > 0 ? '+' : ''}${us(x.delta_us)}</span></h3>
      <div class="hint">Root items (GPU kernels and GPU-idle gaps attributed to the host event that kept the GPU waiting), ranked by contribution; unexplained residual ${us(x.residual_us)}.</div>
      <table class="tbl" id="diff-table"><thead><tr><th>kind</th><th>item</th><th>Δtime</th><th>Δcalls</th><th>base</th><th>compare</th></tr></thead>
      <tbody>${rows(x.items.slice(0, 25))}</tbody></table>
      <h4>Host functions (inclusive)</h4>
      <table class="tbl"><thead><tr><th>kind</th><th>item</th><th>Δtime</th><th>Δcalls</th><th>base</th><th>compare</th></tr></thead><tbody>${rows(x.host_items.slice(0, 15))}</tbody></table></section>`;
  }

  const sl = slider.querySelector('#step-slider');
  const showStep = () => {
    const s = d.steps[+sl.value];
    slider.querySelector('#slider-label').textContent = `step ${s.step}`;
    const meta = window.__aiprof.state.meta; // UI times: the aligned clock after the origin
    const t0 = s.start_ns + (((meta.clock || {}).offset_ns || {})[rank] || 0) - meta.origin_ns;
    slider.querySelector('#step-detail').innerHTML = `<div class="kpis small">
      <div class="kpi"><b>${us(s.duration_us)}</b><span>duration</span></div>
      ${PARTS.map(([k, n]) => `<div class="kpi"><b>${us(s[k])}</b><span>${n}</span></div>`).join('')}
      <div class="kpi"><b>${pct(s.gpu_busy_pct)}</b><span>GPU busy</span></div>
      <div class="kpi"><b>${s.kernels_launched}</b><span>kernels launched</span></div>
      <div class="kpi"><b>${us(s.sync_us)}</b><span>host in sync calls</span></div>
      <div class="kpi"><b>${us(s.dataloader_us)}</b><span>data loading</span></div></div>
      <button id="open-tl">open step ${s.step} in the timeline</button> <button id="open-flame">flame graph of step ${s.step}</button>`;
    slider.querySelector('#open-tl').onclick = () => go('timeline', { rank, t0, t1: t0 + s.duration_us * 1000 });
    slider.querySelector('#open-flame').onclick = () => go('flame', { rank, step: s.step });
  };
  sl.addEventListener('input', showStep);
  showStep();
  if (d.default_diff) {
    diffBox.innerHTML = `<div class="hint">The report's default diff is step ${d.default_diff.base.step} (median) vs step ${d.default_diff.compare.step} (slowest): <button id="default-diff">show it</button></div>`;
    diffBox.querySelector('#default-diff').onclick = () => { picked.splice(0, 2, d.default_diff.base.step, d.default_diff.compare.step); mark(); showDiff(picked[0], picked[1]); };
  }
}
