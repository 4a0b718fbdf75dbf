// Ranks: rank x step heat map, flagged ranks (from the causes), collectives with bandwidth.
import { api } from '../api.js';
import { chart } from '../charts.js';
import { esc, us, pct, bytes, h } from '../fmt.js';

const METRICS = [['duration_us', 'step time'], ['compute_us', 'compute'], ['communication_us', 'exposed communication'], ['idle_us', 'GPU idle']];

export default async function ranks(root) {
  const d = await api('ranks');
  const steps = [...new Set(d.ranks.flatMap((r) => r.steps.map((s) => s.step)))].sort((a, b) => a - b);
  root.appendChild(h(`<div><h2>Ranks <label class="k">metric <select id="metric">${METRICS.map(([k, n]) => `<option value="${k}">${n}</option>`).join('')}</select></label></h2>
    <div class="hint">Abnormal workers: the straggler and the ranks waiting for it are those the job's causes name (cross-rank analysis).</div></div>`));
  const el = h(`<div class="chart" id="c-heat" style="height:${Math.max(160, 60 + 40 * d.ranks.length)}px"></div>`);
  root.appendChild(el);
  // The colour scale spans the values shown (not 0..max: step times of 500 ms that differ by 20 ms
  // would all be dark); cells and scale in ms.
  const draw = (m) => {
    const data = [];
    let lo = Infinity, hi = -Infinity;
    d.ranks.forEach((r, ri) => r.steps.forEach((s) => { data.push([steps.indexOf(s.step), ri, s[m]]); lo = Math.min(lo, s[m]); hi = Math.max(hi, s[m]); }));
    if (!data.length) { lo = 0; hi = 1; }
    if (hi <= lo) { hi = lo + Math.max(1, Math.abs(lo) * 0.01); }
    const label = METRICS.find((x) => x[0] === m)[1];
    chart(el, 'heat', {
      tooltip: { formatter: (p) => `rank ${d.ranks[p.value[1]].rank}, step ${steps[p.value[0]]}: ${label} ${us(p.value[2])}` },
      grid: { left: 150, right: 130, top: 24, bottom: 30 },
      xAxis: { type: 'category', data: steps.map((s) => `step ${s}`) },
      yAxis: { type: 'category', data: d.ranks.map((r) => `rank ${r.rank}${(d.flags[r.rank] || []).length ? ' ⚠ ' + d.flags[r.rank].join(',') : ''}`), inverse: true },
      visualMap: { min: lo, max: hi, calculable: true, orient: 'vertical', right: 10, top: 'middle', itemHeight: 90, precision: 1,
        inRange: { color: ['#f7fbff', '#6baed6', '#08306b'] }, formatter: (v) => `${(v / 1e3).toFixed(1)} ms` },
      title: { text: `${label} per rank and step (ms; colour scale from the smallest to the largest value)`, left: 150, top: 0, textStyle: { fontSize: 11, fontWeight: 'normal', color: '#555' } },
      series: [{ type: 'heatmap', data, label: { show: true, formatter: (p) => `${(p.value[2] / 1000).toFixed(1)} ms`, fontSize: 10 } }],
    });
  };
  const msel = root.querySelector('#metric');
  msel.addEventListener('change', () => draw(msel.value));
  draw('duration_us');
  root.appendChild(h(`<table class="tbl" id="rank-table"><thead><tr><th>rank</th><th>host</th><th>flags</th><th>steps</th><th>median step</th><th>compute</th><th>exposed comm</th><th>comm total</th><th>GPU busy</th></tr></thead><tbody>
    ${d.ranks.map((r) => `<tr class="${(d.flags[r.rank] || []).includes('straggler') ? 'straggler' : ''}"><td>${r.rank}</td><td>${esc(r.host)}</td>
      <td>${(d.flags[r.rank] || []).map((f) => `<span class="badge ${esc(f)}">${esc(f)}</span>`).join(' ')}</td><td>${r.summary.steps ?? 0}</td>
      <td class="num">${us(r.summary.step_median_us)}</td><td class="num">${us(r.summary.compute_us)}</td><td class="num">${us(r.summary.communication_us)}</td>
      <td class="num">${us(r.summary.communication_total_us)}</td><td class="num">${pct(r.summary.gpu_busy_pct)}</td></tr>`).join('')}</tbody></table>`));
  for (const c of d.causes) root.appendChild(h(`<div class="finding cause sev-${esc(c.severity)}" data-code="${esc(c.code)}"><div class="f-head"><code>${esc(c.code)}</code> ${esc(c.title)} <span class="impact">saves ${us(c.saving.per_step_us)} per step · ${pct(100 * c.saving.share)}</span></div><div class="f-sugg">fix: ${esc(c.remedy)}</div></div>`));
  for (const s of d.symptoms) root.appendChild(h(`<div class="finding symptom" data-symptom="${esc(s.code)}">${esc(s.title)}${s.explained_by.length ? '' : ' — no cause found'}</div>`));
  root.appendChild(h('<h3>Communication by collective</h3>'));
  const rows = d.ranks.flatMap((r) => (r.communication.groups || []).map((g) => ({ rank: r.rank, link: r.communication.link, ...g })));
  root.appendChild(rows.length ? h(`<table class="tbl" id="comm-table"><thead><tr><th>rank</th><th>collective</th><th>group</th><th>size</th><th>calls</th><th>bytes/call</th><th>total</th><th>mean</th><th>algbw GB/s</th><th>busbw GB/s</th><th>link</th></tr></thead><tbody>
    ${rows.map((g) => `<tr><td>${g.rank}</td><td>${esc(g.coll)}</td><td>${esc(g.pg)} (${g.group_size})</td><td>${esc(g.size_bucket)}</td><td class="num">${g.calls}</td><td class="num">${bytes(g.bytes_per_call)}</td>
      <td class="num">${us(g.total_us)}</td><td class="num">${us(g.mean_us)}</td><td class="num">${g.algbw_gbps?.toFixed(1) ?? '–'}</td><td class="num">${g.busbw_gbps?.toFixed(1) ?? '–'}</td><td>${esc(g.link)}</td></tr>`).join('')}</tbody></table>`)
    : h('<div class="empty">No collectives in this capture.</div>'));
}
