// aiprof probe engine, loaded by Frida into the traced process (aiprof/native/engine.py).
// One CModule records every hooked call (start/end on CLOCK_REALTIME, thread, raw arguments,
// return value) into a bounded ring; the sidecar drains it over RPC. Nothing here allocates
// or takes a lock on the traced thread: a full ring drops the record and counts it.
// Written for Frida 16 and 17 alike (no static Module.* lookups, which 17 removed).
'use strict';

const CFG = JSON.parse(PARAMS_JSON);   // {cap, rec_size, libraries: [{name, pattern, symbols: [{name, nargs, deref_mask}]}]}
const MAXARGS = 8;

const csrc = `
#include <gum/guminterceptor.h>

#define MAXARGS 8
typedef struct { guint64 seq, t0, t1, ret; guint64 args[MAXARGS]; guint32 tid, sym; } Rec;
typedef struct { guint64 t0; guint64 args[MAXARGS]; } Inv;
typedef struct { gint64 sec, nsec; } Ts;

extern int clock_gettime(int clk, Ts *ts);
extern void *memcpy(void *d, const void *s, gsize n);

extern Rec ring[];
/* ctl: 0 head (reserved), 1 tail (drained), 2 lost (overwritten or stuck), 3 capacity,
   4 fence word, 5 slot the drain is waiting on, 6 drains spent waiting on it */
extern volatile gsize ctl[];   /* CModule globals are read-only: both live in JS-allocated memory */

static inline guint64 now_ns(void) {
  Ts ts; clock_gettime(0 /* CLOCK_REALTIME: the agent converts it to the trace clock */, &ts);
  return (guint64) ts.sec * 1000000000ull + (guint64) ts.nsec;
}

void onEnter(GumInvocationContext *ic) {
  Inv *s = GUM_IC_GET_INVOCATION_DATA(ic, Inv);
  gsize d = (gsize) gum_invocation_context_get_listener_function_data(ic);
  guint n = (d >> 16) & 0xff, i;
  for (i = 0; i < n && i < MAXARGS; i++)
    s->args[i] = (guint64) gum_invocation_context_get_nth_argument(ic, i);
  s->t0 = now_ns();
}

/* A flight-recorder ring: a writer never waits and never checks for room (TinyCC has no
   compare-and-swap); a record the drain has not taken yet is overwritten and counted lost. */
void onLeave(GumInvocationContext *ic) {
  guint64 t1 = now_ns();
  Inv *s = GUM_IC_GET_INVOCATION_DATA(ic, Inv);
  gsize d = (gsize) gum_invocation_context_get_listener_function_data(ic);
  guint n = (d >> 16) & 0xff, mask = (d >> 24) & 0xff, i;
  gsize h = g_atomic_pointer_add(&ctl[0], 1);
  Rec *r = &ring[h % ctl[3]];
  r->seq = 0;                       /* being written: a concurrent drain skips it */
  g_atomic_pointer_add(&ctl[4], 0); /* full fence */
  r->t0 = s->t0; r->t1 = t1; r->sym = (guint32) (d & 0xffff);
  r->tid = (guint32) gum_invocation_context_get_thread_id(ic);
  r->ret = (guint64) gum_invocation_context_get_return_value(ic);
  for (i = 0; i < MAXARGS; i++) {
    guint64 a = i < n ? s->args[i] : 0;
    if (((mask >> i) & 1) && a != 0 && r->ret == 0) a = *(guint64 *) a;  /* out-pointer, read on success */
    r->args[i] = a;
  }
  g_atomic_pointer_add(&ctl[4], 0);
  r->seq = h + 1;                   /* published last */
}

#define STUCK_DRAINS 20  /* a slot reserved but unwritten for this many drains: its writer died */

/* Copy committed records [tail, head) into out (at most max); advance tail. Returns the count. */
gsize aiprof_drain(Rec *out, gsize max) {
  gsize t = ctl[1], h = ctl[0], cap = ctl[3], k = 0;
  g_atomic_pointer_add(&ctl[4], 0);
  if (h > cap && t < h - cap) { ctl[2] += (h - cap) - t; t = h - cap; }  /* lapped: overwritten */
  while (t < h && k < max) {
    Rec *r = &ring[t % cap];
    guint64 s1 = r->seq;
    if (s1 > t + 1) { ctl[2]++; t++; continue; }          /* overwritten by a later lap */
    if (s1 != t + 1) {                                     /* reserved, not yet published */
      if (ctl[5] == t + 1 && ++ctl[6] >= STUCK_DRAINS) { ctl[2]++; t++; ctl[6] = 0; continue; }
      if (ctl[5] != t + 1) { ctl[5] = t + 1; ctl[6] = 0; }
      break;
    }
    memcpy(&out[k], r, sizeof(Rec));
    g_atomic_pointer_add(&ctl[4], 0);
    if (r->seq != s1) { ctl[2]++; t++; continue; }        /* torn: overwritten while copied */
    k++; t++;
  }
  ctl[1] = t;
  return k;
}
`;

function libcExport(name) {
  for (const m of Process.enumerateModules()) {
    if (/^(libc\.so|libc-|ld-musl)/.test(m.name)) {
      const p = m.findExportByName(name);
      if (p !== null) return p;
    }
  }
  throw new Error('libc export not found: ' + name);
}

const REC = CFG.rec_size;
const ring = Memory.alloc(REC * CFG.cap);
const ctl = Memory.alloc(8 * 8);
ctl.add(24).writeU64(CFG.cap);
const cm = new CModule(csrc, {
  clock_gettime: libcExport('clock_gettime'), memcpy: libcExport('memcpy'), ring: ring, ctl: ctl,
});
const drainFn = new NativeFunction(cm.aiprof_drain, 'size_t', ['pointer', 'size_t']);
const DRAIN_MAX = CFG.drain_max;
const out = Memory.alloc(REC * DRAIN_MAX);

const listeners = {};   // "lib:sym" -> listener
const hookedAddr = {};  // address -> key: a symbol exported by two names is hooked once
const seenModules = {};

function globToRe(g) {
  return new RegExp('^' + g.replace(/[.+^${}()|[\]\\]/g, '\\$&').replace(/\*/g, '.*').replace(/\?/g, '.') + '$');
}
const libs = CFG.libraries.map(l => Object.assign({}, l, { re: globToRe(l.pattern) }));

function lookup(m, name) {
  let p = m.findExportByName(name);
  if (p === null && typeof m.findSymbolByName === 'function') {
    try { p = m.findSymbolByName(name); } catch (e) { p = null; }
  }
  return p;
}

// Frida 17 tells us when a library is loaded; without that every scan enumerates (Frida 16.7 has
// the call, but it was seen not to report a dlopen here)
let dirty = true;
const observed = parseInt(Frida.version.split('.')[0], 10) >= 17 && typeof Process.attachModuleObserver === 'function';
if (observed) Process.attachModuleObserver({ onAdded: function () { dirty = true; } });

function scan(force) {
  const events = [];
  if (observed && !dirty && !force) return events;
  dirty = false;
  // (Frida 16.7's module list was seen to miss a library dlopen'ed after the attach, and its
  // Module.load of such a library to kill the process: with Frida 16 only libraries loaded
  // before the attach are hooked; docs/capture.md)
  for (const m of Process.enumerateModules()) {
    if (seenModules[m.path]) continue;
    seenModules[m.path] = true;
    libs.forEach(lib => {
      if (!lib.re.test(m.name)) return;
      lib.symbols.forEach(s => {
        const key = lib.name + ':' + s.name;
        if (listeners[key]) return;
        const p = lookup(m, s.name);
        if (p === null) { events.push({ event: 'missing', lib: lib.name, symbol: s.name, module: m.path }); return; }
        if (hookedAddr[p.toString()]) return;
        const data = ptr((s.id & 0xffff) | ((s.nargs & 0xff) << 16) | ((s.deref_mask & 0xff) << 24));
        try {
          listeners[key] = Interceptor.attach(p, cm, data);
          hookedAddr[p.toString()] = key;
          events.push({ event: 'hooked', lib: lib.name, symbol: s.name, module: m.path, address: p.toString() });
        } catch (e) {
          events.push({ event: 'error', lib: lib.name, symbol: s.name, module: m.path, error: String(e) });
        }
      });
    });
  }
  Interceptor.flush();
  return events;
}

rpc.exports = {
  scan: function (force) { return scan(!!force); },
  observed: function () { return observed; },
  drain: function () {
    const n = Number(drainFn(out, DRAIN_MAX));
    return n === 0 ? null : out.readByteArray(n * REC);
  },
  stats: function () {
    return { head: ctl.readU64().toString(), tail: ctl.add(8).readU64().toString(), lost: ctl.add(16).readU64().toString() };
  },
  unhook: function (key) {
    const l = listeners[key];
    if (!l) return false;
    l.detach();
    delete listeners[key];
    Interceptor.flush();
    return true;
  },
  unhookAll: function () {
    for (const k of Object.keys(listeners)) { listeners[k].detach(); delete listeners[k]; }
    Interceptor.flush();
    return true;
  },
};
