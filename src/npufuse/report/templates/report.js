/* npufuse validation report: draws the charts from the REPORT_DATA block with the bundled uPlot.
 * Text from the user's repo is never written into the DOM here (the server-side template shows
 * it, escaped); this script only reads numbers. Progress is left on <body> so a headless browser
 * (the tests) can tell the charts were drawn: data-charts-expected, data-charts-drawn,
 * data-charts-failed; each chart element gets data-drawn and data-series-ink (pixels in a series
 * colour, i.e. the lines really reached the canvas). */
(function () {
  "use strict";
  var body = document.body;
  var COLORS = { baseline: [59, 110, 168], fused: [217, 130, 43], diff: [120, 120, 120] };
  var expected = 0, drawn = 0, failed = 0, charts = [];

  function rgb(c, a) { return a == null ? "rgb(" + c.join(",") + ")" : "rgba(" + c.join(",") + "," + a + ")"; }
  function mark() {
    body.setAttribute("data-charts-expected", String(expected));
    body.setAttribute("data-charts-drawn", String(drawn));
    body.setAttribute("data-charts-failed", String(failed));
  }
  function fmt(v, digits) {
    if (v == null || !isFinite(v)) return "—";
    return String(parseFloat(Number(v).toPrecision(digits || 4)));
  }
  function scaled(arr, k) { return arr.map(function (v) { return v == null ? null : v * k; }); }

  // Pixels close to a series colour: proof that lines, not just axes, were drawn.
  function seriesInk(u) {
    var cv = u.ctx.canvas, n = 0;
    try {
      var px = u.ctx.getImageData(0, 0, cv.width, cv.height).data;
      for (var i = 0; i < px.length; i += 4) {
        if (px[i + 3] < 128) continue;
        for (var key in COLORS) {
          var c = COLORS[key];
          if (key !== "diff" && Math.abs(px[i] - c[0]) < 40 && Math.abs(px[i + 1] - c[1]) < 40 && Math.abs(px[i + 2] - c[2]) < 40) { n++; break; }
        }
      }
    } catch (e) { return -1; }
    return n;
  }

  function chartWidth(el) { return Math.max(320, Math.min(1150, el.clientWidth || 900)); }

  function makeChart(el, opts, data) {
    expected++;
    var first = true;
    opts.width = chartWidth(el);
    opts.height = opts.height || 260;
    opts.hooks = opts.hooks || {};
    opts.hooks.draw = (opts.hooks.draw || []).concat([function (u) {
      if (!first) return;
      first = false;
      drawn++;
      el.setAttribute("data-drawn", "1");
      el.setAttribute("data-series-ink", String(seriesInk(u)));
      mark();
    }]);
    try {
      charts.push([el, new uPlot(opts, data, el)]);
    } catch (e) {
      failed++;
      el.className += " chart-error";
      el.textContent = "chart could not be drawn: " + e.message;
      body.setAttribute("data-chart-error", String(e.message));
    }
    mark();
  }

  function line(label, color, extra) {
    var s = { label: label, stroke: rgb(color), width: 1.5, spanGaps: false, points: { show: false },
              value: function (u, v) { return fmt(v, 5); } };
    for (var k in extra || {}) s[k] = extra[k];
    return s;
  }

  // Shade the warm-up steps (excluded from the step-time statistics).
  function warmupShade(endStep) {
    return function (u) {
      var xs = u.data[0];
      if (!xs.length || endStep <= xs[0]) return;
      var x0 = u.valToPos(xs[0], "x", true);
      var x1 = u.valToPos(Math.min(endStep - 0.5, xs[xs.length - 1]), "x", true);
      u.ctx.save();
      u.ctx.fillStyle = "rgba(0,0,0,0.06)";
      u.ctx.fillRect(x0, u.bbox.top, Math.max(1, x1 - x0), u.bbox.height);
      u.ctx.restore();
    };
  }

  function lossChart(el, c) {
    var s = c.series;
    var hasDiff = s.rel_diff_pct.some(function (v) { return v != null; });
    var series = [{ label: "step" }, line("baseline", COLORS.baseline), line("fused", COLORS.fused)];
    var data = [s.steps, s.baseline_loss, s.fused_loss];
    var bands;
    if (s.band_lo && s.band_hi) {  // the tolerance band around the baseline, under the curves
      series.push(line("baseline − tol", COLORS.diff, { width: 0.5, stroke: rgb(COLORS.diff, 0.35) }));
      series.push(line("baseline + tol", COLORS.diff, { width: 0.5, stroke: rgb(COLORS.diff, 0.35) }));
      data.push(s.band_lo, s.band_hi);
      bands = [{ series: [4, 3], fill: rgb(COLORS.diff, 0.15) }];
    }
    var axes = [{ label: "step" }, { label: "loss" }];
    var scales = { x: { time: false } };
    if (hasDiff) {
      series.push(line("fused vs baseline %", COLORS.diff, { scale: "pct", width: 1, dash: [4, 4] }));
      data.push(s.rel_diff_pct);
      axes.push({ side: 1, scale: "pct", label: "relative difference %", grid: { show: false } });
      // symmetric around 0 and at least ±0.5 %, so a flat zero line does not fill the chart
      scales.pct = { range: function (u, lo, hi) { var m = Math.max(0.5, Math.abs(lo || 0), Math.abs(hi || 0)) * 1.15; return [-m, m]; } };
    }
    var opts = { scales: scales, series: series, axes: axes };
    if (bands) opts.bands = bands;
    makeChart(el, opts, data);
  }

  function stepTimeChart(el, c) {
    var s = c.series, k = c.time_scale;
    makeChart(el, {
      scales: { x: { time: false } },
      series: [{ label: "step" }, line("baseline", COLORS.baseline), line("fused", COLORS.fused)],
      axes: [{ label: "step" }, { label: "step time (" + c.time_unit + ")" }],
      hooks: { drawClear: [warmupShade(s.warmup_end)] }
    }, [s.steps, scaled(s.baseline_time, k), scaled(s.fused_time, k)]);
  }

  function histChart(el, c) {
    var h = c.hist, k = c.time_scale;
    var stepped = uPlot.paths && uPlot.paths.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;
    function bars(counts) { return counts.concat([0]); }  // one value per edge; the last closes the bin
    makeChart(el, {
      height: 220,
      scales: { x: { time: false }, y: { range: function (u, lo, hi) { return [0, Math.max(1, hi) * 1.1]; } } },
      series: [
        { label: c.time_unit, value: function (u, v) { return fmt(v, 4); } },
        line("baseline", COLORS.baseline, { paths: stepped, fill: rgb(COLORS.baseline, 0.25) }),
        line("fused", COLORS.fused, { paths: stepped, fill: rgb(COLORS.fused, 0.25) })
      ],
      axes: [{ label: "step time (" + c.time_unit + ")" }, { label: "steps" }]
    }, [scaled(h.edges, k), bars(h.baseline), bars(h.fused)]);
  }

  var data;
  try {
    data = JSON.parse(document.getElementById("report-data").textContent);
  } catch (e) {
    body.setAttribute("data-chart-error", "REPORT_DATA could not be read: " + e.message);
    return;
  }
  if (typeof uPlot === "undefined") {
    body.setAttribute("data-chart-error", "the bundled uPlot did not load");
    return;
  }
  var byId = {};
  data.candidates.forEach(function (c) { byId[String(c.id)] = c; });
  var draw = { loss: lossChart, step_time: stepTimeChart, step_time_hist: histChart };
  Array.prototype.forEach.call(document.querySelectorAll("div.chart[data-chart]"), function (el) {
    var c = byId[el.getAttribute("data-candidate")];
    var f = draw[el.getAttribute("data-chart")];
    if (c && f) f(el, c);
  });
  mark();
  // the page's own width after layout (tests: no horizontal overflow at 1280 px)
  body.setAttribute("data-scroll-width", String(document.documentElement.scrollWidth));
  window.addEventListener("resize", function () {
    charts.forEach(function (pair) { pair[1].setSize({ width: chartWidth(pair[0]), height: pair[1].height }); });
  });
})();
