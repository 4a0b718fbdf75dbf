// Flame graph: the project's own interactive flame graph (aiprof.flame), GPU and CPU views.
import { esc, h } from '../fmt.js';

export default async function flame(root, { rank, meta, params, go }) {
  const r = meta.ranks.find((x) => x.rank === rank) || meta.ranks[0];
  const step = params.get('step') || '';
  root.appendChild(h(`<div class="bar"><h2 style="display:inline">Flame graph</h2>
    <label class="k">step <select id="flame-step"><option value="">all steps</option>${r.steps.map((s) => `<option value="${s}" ${String(s) === step ? 'selected' : ''}>step ${s}</option>`).join('')}</select></label>
    <span class="hint">GPU view: GPU time under the Python/op stacks that launched it · CPU view: host time. Click to zoom, search with a regex.</span></div>`));
  const src = `flame.html?rank=${rank}${step ? '&step=' + esc(step) : ''}`;
  root.appendChild(h(`<iframe id="flame-frame" class="flame" src="${src}" title="flame graph"></iframe>`));
  root.querySelector('#flame-step').addEventListener('change', (e) => go('flame', { rank, ...(e.target.value ? { step: e.target.value } : {}) }));
  await new Promise((res) => { const f = root.querySelector('#flame-frame'); f.addEventListener('load', res, { once: true }); setTimeout(res, 20000); });
}
