// ECharts wrapper: one instance per panel, registered in window.__aiprof.charts so tests (and
// curious users in devtools) can read exactly what is drawn.
// Only the chart types and components the pages use (a third of the full bundle to parse).
import * as echarts from 'echarts/core';
import { BarChart, HeatmapChart, LineChart, PieChart } from 'echarts/charts';
import { GridComponent, LegendComponent, MarkAreaComponent, MarkLineComponent, TitleComponent, TooltipComponent,
  VisualMapComponent } from 'echarts/components';
import { CanvasRenderer } from 'echarts/renderers';

echarts.use([BarChart, HeatmapChart, LineChart, PieChart, GridComponent, LegendComponent, MarkAreaComponent,
  MarkLineComponent, TitleComponent, TooltipComponent, VisualMapComponent, CanvasRenderer]);

window.__aiprof = window.__aiprof || { charts: {} };
const live = new Set();

export function chart(el, name, option) {
  const old = echarts.getInstanceByDom(el);
  if (old) old.dispose();
  const c = echarts.init(el, null, { renderer: 'canvas' });
  c.setOption({ animation: false, textStyle: { fontFamily: 'system-ui, sans-serif' }, ...option });
  window.__aiprof.charts[name] = c;
  live.add(c);
  return c;
}

export function disposeAll() {
  for (const c of live) if (!c.isDisposed()) c.dispose();
  live.clear();
  window.__aiprof.charts = {};
}

window.addEventListener('resize', () => { for (const c of live) if (!c.isDisposed()) c.resize(); });

export const PALETTE = { compute: '#4e79a7', communication: '#f28e2b', memory: '#59a14f', idle: '#bab0ac', busy: '#4e79a7' };
export { echarts };
