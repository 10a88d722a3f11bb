/* gpupool charts: a thin layer over the vendored uPlot (static/vendor/uplot, MIT) and the fleet heat map.
 *
 *   GpupoolCharts.lines(el, {x, series: [{label, values}], unit, max})  -> a uPlot line chart
 *   [data-node-charts] + <script id="node-telemetry">  -> the four telemetry charts of a node page
 *   [data-heatmap]     + <script id="fleet-initial">   -> heat map colours and the hover tooltip
 *
 * Both follow the live "fleet.snapshot" events that live.js re-dispatches as "gpupool:event".
 */
(function () {
  "use strict";

  var PALETTE = ["#4f46e5", "#0ea5e9", "#10b981", "#f59e0b", "#ef4444", "#8b5cf6", "#ec4899", "#14b8a6",
    "#64748b", "#84cc16", "#f97316", "#06b6d4", "#a855f7", "#22c55e", "#eab308", "#3b82f6"];
  var METRICS = { util: 1, mem: 2, power: 3, temp: 4 }; // column in a snapshot row
  var PLACES = { util: 0, mem: 1, power: 0, temp: 0 };

  function readJson(id) {
    var el = document.getElementById(id);
    if (!el) return null;
    try { return JSON.parse(el.textContent); } catch (e) { return null; }
  }

  function fmt(v, places, unit) {
    return v === null || v === undefined ? "–" : Number(v).toFixed(places) + " " + unit;
  }

  /* A line chart: one series per entry; values may hold nulls (gaps are bridged). */
  function lines(el, spec) {
    var width = Math.max(240, el.clientWidth || 320);
    var places = spec.places === undefined ? 1 : spec.places;
    var opts = {
      width: width,
      height: spec.height || 190,
      cursor: { sync: { key: spec.sync || "gpupool" }, points: { size: 6 } },
      legend: { show: spec.legend !== false, live: true },
      scales: {
        x: { time: true },
        y: spec.max ? { range: [0, spec.max] } : { range: function (u, lo, hi) { return [0, hi > 0 ? hi * 1.15 : 1]; } }
      },
      axes: [
        { stroke: "#64748b", grid: { stroke: "#eef2f7", width: 1 }, ticks: { stroke: "#e2e8f0" }, font: "11px system-ui, sans-serif" },
        { stroke: "#64748b", grid: { stroke: "#eef2f7", width: 1 }, ticks: { stroke: "#e2e8f0" }, size: 44, font: "11px system-ui, sans-serif",
          values: function (u, ticks) { return ticks.map(function (t) { return String(+t.toFixed(1)); }); } }
      ],
      series: [{ value: "{YYYY}-{MM}-{DD} {HH}:{mm}:{ss}" }].concat(spec.series.map(function (s, i) {
        var color = PALETTE[i % PALETTE.length];
        return {
          label: s.label, stroke: color, width: 1.6, spanGaps: true, points: { show: false },
          fill: spec.series.length === 1 ? color + "22" : undefined,
          value: function (u, v) { return fmt(v, places, spec.unit || ""); }
        };
      }))
    };
    var data = [spec.x.slice()].concat(spec.series.map(function (s) { return s.values.slice(); }));
    var chart = new window.uPlot(opts, data, el);
    if (window.ResizeObserver) {
      new ResizeObserver(function () {
        var w = Math.max(240, el.clientWidth);
        if (Math.abs(w - chart.width) > 4) chart.setSize({ width: w, height: opts.height });
      }).observe(el);
    }
    return chart;
  }

  /* The node page: util / mem / power / temp, one line per GPU, following the live snapshots. */
  function nodeCharts(root) {
    var t = readJson("node-telemetry");
    if (!t || !window.uPlot) return;
    var ids = t.gpus.map(function (g) { return g.id; });
    var charts = [];
    root.querySelectorAll("[data-chart]").forEach(function (el) {
      var metric = el.getAttribute("data-chart");
      var chart = lines(el, {
        x: t.x,
        series: t.gpus.map(function (g, i) { return { label: g.label, values: t[metric][i] }; }),
        unit: el.getAttribute("data-unit"),
        max: Number(el.getAttribute("data-max")) || null,
        places: PLACES[metric],
        sync: "node-" + root.getAttribute("data-node-charts")
      });
      el.setAttribute("data-points", String(t.x.length));
      charts.push({ metric: metric, chart: chart, el: el });
    });
    document.addEventListener("gpupool:event", function (e) {
      var ev = e.detail;
      if (ev.type !== "fleet.snapshot") return;
      var rows = {};
      ev.g.forEach(function (r) { rows[r[0]] = r; });
      if (!ids.some(function (id) { return rows[id] && rows[id][1] !== null; })) return;
      var cutoff = ev.ts - t.window_s;
      charts.forEach(function (c) {
        var data = c.chart.data;
        var xs = data[0];
        if (xs.length && xs[xs.length - 1] >= ev.ts) return; // already have this moment
        var next = [xs.concat([ev.ts])];
        ids.forEach(function (id, i) {
          var r = rows[id];
          next.push(data[i + 1].concat([r ? r[METRICS[c.metric]] : null]));
        });
        var drop = 0;
        while (drop < next[0].length - 1 && next[0][drop] < cutoff) drop++;
        if (drop) next = next.map(function (arr) { return arr.slice(drop); });
        c.chart.setData(next);
        c.el.setAttribute("data-points", String(next[0].length));
      });
    });
  }

  /* The heat map: a colour bucket per cell, a tooltip from the latest values. */
  function heatmap(root) {
    var initial = readJson("fleet-initial") || { g: [], models: [] };
    var models = initial.models || [];
    var values = {};
    var cells = {};
    root.querySelectorAll("i.hc[data-g]").forEach(function (cell) { cells[cell.getAttribute("data-g")] = cell; });
    function bucket(u) { return u === null || u === undefined ? "ux" : "u" + Math.min(10, Math.max(0, Math.floor(u / 10))); }
    function apply(rows, paint) {
      rows.forEach(function (r) {
        values[r[0]] = r;
        var cell = paint && cells[r[0]];
        if (!cell) return;
        var flag = cell.classList.contains("bad") ? " bad" : cell.classList.contains("iso") ? " iso" : "";
        var cls = "hc " + bucket(r[1]) + flag;
        if (cell.className !== cls) cell.className = cls;
      });
      root.setAttribute("data-updated", String(Date.now()));
    }
    apply(initial.g, false);

    var tip = document.createElement("div");
    tip.className = "hm-tip";
    tip.setAttribute("role", "tooltip");
    tip.hidden = true;
    document.body.appendChild(tip);
    function line(label, value) {
      var row = document.createElement("div");
      var a = document.createElement("span");
      a.textContent = label;
      var b = document.createElement("strong");
      b.textContent = value;
      row.appendChild(a);
      row.appendChild(b);
      return row;
    }
    root.addEventListener("mouseover", function (e) {
      var cell = e.target.closest("i.hc[data-g]");
      if (!cell) { tip.hidden = true; return; }
      var node = cell.closest(".hm-node");
      var r = values[cell.getAttribute("data-g")] || [];
      var model = models[Number(cell.getAttribute("data-k"))] || ["?", 0];
      tip.textContent = "";
      var head = document.createElement("div");
      head.className = "hm-tip-head";
      head.textContent = node.querySelector(".hm-name").textContent + " · GPU " + cell.getAttribute("data-i");
      tip.appendChild(head);
      tip.appendChild(line("Model", model[0] + (model[1] ? " · " + model[1] + " GiB" : "")));
      tip.appendChild(line("Utilisation", fmt(r[1], 0, "%")));
      tip.appendChild(line("Memory", r[2] === null || r[2] === undefined ? "–" : r[2].toFixed(1) + " / " + model[1] + " GiB"));
      tip.appendChild(line("Temperature", fmt(r[4], 0, "°C")));
      tip.appendChild(line("Power", fmt(r[3], 0, "W")));
      if (cell.classList.contains("bad")) tip.appendChild(line("Health", "unhealthy"));
      else if (cell.classList.contains("iso")) tip.appendChild(line("Health", "isolated"));
      tip.hidden = false;
      var box = cell.getBoundingClientRect();
      var bounds = root.getBoundingClientRect(); // keep the tip over the heat map, not the sidebar
      var left = Math.min(bounds.right - tip.offsetWidth, box.left + box.width / 2 - tip.offsetWidth / 2);
      tip.style.left = Math.max(bounds.left, left) + window.scrollX + "px";
      tip.style.top = box.top + window.scrollY - tip.offsetHeight - 8 + "px";
    });
    root.addEventListener("mouseleave", function () { tip.hidden = true; });
    document.addEventListener("gpupool:event", function (e) {
      var ev = e.detail;
      if (ev.type === "fleet.snapshot") apply(ev.g, true);
      if (ev.type === "gpu.health") {
        var cell = cells[ev.gpu];
        if (!cell) return;
        cell.classList.toggle("bad", ev.health === "unhealthy");
        cell.classList.toggle("iso", ev.health !== "unhealthy" && ev.isolated);
      }
    });
  }

  window.GpupoolCharts = { lines: lines, palette: PALETTE };

  function init() {
    document.querySelectorAll("[data-node-charts]").forEach(nodeCharts);
    document.querySelectorAll("[data-heatmap]").forEach(heatmap);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
