// JSON API client. In a static report (`aiprof analyze --html`) the data is embedded in the
// page as window.__AIPROF_STATIC__ and only the overview exists.
export const STATIC = window.__AIPROF_STATIC__ || null;

export class ApiError extends Error {}

export async function api(path, params = {}, signal) {
  if (STATIC) {
    if (path === 'meta') return STATIC.meta;
    if (path === 'overview') return STATIC.overview[String(params.rank)];
    if (path === 'annotation') {
      const h = (STATIC.annotations[String(params.rank)] || {})[params.name];
      if (h) return h;
    }
    throw new ApiError('not available in a static report: run `aiprof ui`');
  }
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null) q.set(k, v);
  const r = await fetch(`api/${path}?${q}`, { signal });
  const body = await r.json();
  if (!r.ok) throw new ApiError(body.error || r.statusText);
  return body;
}
