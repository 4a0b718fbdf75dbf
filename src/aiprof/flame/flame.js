// aiprof flame graph: click to zoom, search (regex) with matched %, like flamegraph.pl.
// Each svg.aiprof-flame element carries its frames as g.f elements with data-x, data-w, data-d;
// x/w are in weight units (ns or samples), d is the depth (root = 0).
(function () {
  if (window.aiprofFlame) return;
  function fmt(v, unit) {
    if (unit !== "nanoseconds") return v.toLocaleString() + " samples";
    var a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(3) + " s";
    if (a >= 1e6) return (v / 1e6).toFixed(3) + " ms";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + " us";
    return v + " ns";
  }
  function init(svg) {
    if (svg.__flame) return svg.__flame;
    var W = +svg.dataset.width, pad = 10, total = +svg.dataset.total, unit = svg.dataset.unit;
    var frames = Array.prototype.slice.call(svg.querySelectorAll("g.f"));
    var details = svg.querySelector(".details"), matched = svg.querySelector(".matched");
    var unzoom = svg.querySelector(".unzoom");
    var st = { x0: 0, w0: total, d0: 0, re: null };
    frames.forEach(function (g) {
      g.__x = +g.dataset.x; g.__w = +g.dataset.w; g.__d = +g.dataset.d;
      g.__r = g.querySelector("rect"); g.__t = g.querySelector("text");
      g.__name = g.dataset.n || g.__t.textContent; g.__fill = g.__r.getAttribute("fill");
      g.__tip = g.querySelector("title").textContent;
      g.addEventListener("click", function () { zoom(g); });
      g.addEventListener("mouseover", function () { details.textContent = g.__tip; });
      g.addEventListener("mouseout", function () { details.textContent = " "; });
    });
    function layout() {
      var scale = (W - 2 * pad) / st.w0;
      frames.forEach(function (g) {
        var inside = g.__x >= st.x0 && g.__x + g.__w <= st.x0 + st.w0 + 1e-6 && g.__d >= st.d0;
        var above = g.__d < st.d0 && g.__x <= st.x0 && g.__x + g.__w >= st.x0 + st.w0 - 1e-6;
        var x, w;
        if (inside) { x = pad + (g.__x - st.x0) * scale; w = g.__w * scale; }
        else if (above) { x = pad; w = W - 2 * pad; }
        else { g.style.display = "none"; return; }
        if (w < 0.1) { g.style.display = "none"; return; }
        g.style.display = "";
        g.style.opacity = above ? 0.6 : 1;
        g.__r.setAttribute("x", x); g.__r.setAttribute("width", w);
        g.__t.setAttribute("x", x + 3);
        var n = Math.floor((w - 6) / 7);
        g.__t.textContent = n < 3 ? "" : (g.__name.length <= n ? g.__name : g.__name.slice(0, n - 2) + "..");
      });
      unzoom.style.opacity = st.w0 < total || st.d0 > 0 ? 1 : 0.3;
    }
    function zoom(g) { st.x0 = g.__x; st.w0 = g.__w; st.d0 = g.__d; layout(); if (st.re) search(st.re); }
    function reset() { st.x0 = 0; st.w0 = total; st.d0 = 0; layout(); if (st.re) search(st.re); }
    // matched share: union of matching frames' spans (a match inside a match counts once)
    function search(re) {
      if (typeof re === "string") { try { re = re ? new RegExp(re) : null; } catch (e) { re = null; } }
      st.re = re;
      var spans = [];
      frames.forEach(function (g) {
        var hit = re && re.test(g.__name);
        g.__r.setAttribute("fill", hit ? "rgb(230,0,230)" : g.__fill);
        if (hit && g.__x >= st.x0 && g.__x + g.__w <= st.x0 + st.w0 + 1e-6) spans.push([g.__x, g.__x + g.__w]);
      });
      spans.sort(function (a, b) { return a[0] - b[0] || b[1] - a[1]; });
      var sum = 0, end = -Infinity;
      spans.forEach(function (s) { if (s[0] >= end) { sum += s[1] - s[0]; end = s[1]; } else if (s[1] > end) { sum += s[1] - end; end = s[1]; } });
      var pct = st.w0 ? 100 * sum / st.w0 : 0;
      matched.textContent = re ? "Matched: " + pct.toFixed(1) + "% (" + fmt(sum, unit) + ")" : "";
      svg.dataset.matched = re ? pct.toFixed(3) : "";
      return pct;
    }
    unzoom.addEventListener("click", reset);
    var sb = svg.querySelector(".search");
    if (sb) sb.addEventListener("click", function () {
      var t = window.prompt("Search frames (regular expression):", st.re ? st.re.source : "");
      if (t !== null) search(t);
    });
    layout();
    svg.__flame = { search: search, reset: reset, zoom: zoom };
    return svg.__flame;
  }
  window.aiprofFlame = init;
  window.aiprofFlameQuery = function () {
    var m = /[?&]s=([^&]*)/.exec(window.location.search);
    return m ? decodeURIComponent(m[1].replace(/\+/g, " ")) : "";
  };
})();
