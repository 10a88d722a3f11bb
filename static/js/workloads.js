/* gpupool workload pages: the launch form's fields per kind and plan, the live detail page and the
 * list's "new workloads" note. Live events come from live.js as "gpupool:event" (live.js itself
 * updates every [data-workload-state] badge).
 *
 *   #launch-form                 fields marked .kind-instance / .kind-job / .plan-spot / .plan-reserved
 *                                show only where they apply (a field with an error always shows)
 *   [data-workload-page="<id>"]  on a workload.state event of <id>: reload #workload-live (its
 *                                data-live-url) and the GPU charts (data-telemetry-url); the charts
 *                                also poll every 10 s while the workload holds GPUs
 *   [data-new-workloads]         counts workloads submitted elsewhere since the list loaded
 */
(function () {
  "use strict";

  var POLL_MS = 10000;

  function readJson(id) {
    var el = document.getElementById(id);
    if (!el) return null;
    try { return JSON.parse(el.textContent); } catch (e) { return null; }
  }

  /* --- the launch form ------------------------------------------------------------------------ */
  function launchForm(form) {
    function checked(name) {
      var el = form.querySelector('input[name="' + name + '"]:checked') || form.querySelector('select[name="' + name + '"]');
      return el ? el.value : "";
    }
    function sync() {
      var kind = checked("kind");
      var plan = checked("plan");
      var show = { "kind-instance": kind === "instance", "kind-job": kind === "job",
        "plan-spot": plan === "spot", "plan-reserved": plan === "reserved" };
      Object.keys(show).forEach(function (cls) {
        form.querySelectorAll("." + cls).forEach(function (el) {
          el.hidden = !show[cls] && !el.classList.contains("field-invalid");
        });
      });
    }
    form.addEventListener("change", sync);
    sync();
  }

  /* --- a workload's page ---------------------------------------------------------------------- */
  function workloadPage(root) {
    var id = String(root.getAttribute("data-workload-page"));
    var liveUrl = root.getAttribute("data-live-url");
    var telemetryUrl = root.getAttribute("data-telemetry-url");
    var grid = root.querySelector("[data-workload-charts]");
    var charts = [];
    var pending = null;
    var poller = null;

    function draw(t) {
      if (!grid || !window.GpupoolCharts || !t || !t.gpus) return;
      var empty = root.querySelector("[data-chart-empty]");
      if (empty) empty.hidden = t.x.length > 0;
      var noGpus = root.querySelector("[data-no-gpus]");
      if (noGpus && t.gpus.length) noGpus.hidden = true;
      grid.hidden = t.gpus.length === 0;
      grid.setAttribute("data-holding", t.holding ? "true" : "false");
      var sameSeries = charts.length && charts[0].chart.series.length === t.gpus.length + 1;
      grid.querySelectorAll("[data-chart]").forEach(function (el, i) {
        var metric = el.getAttribute("data-chart");
        var data = [t.x].concat(t.gpus.map(function (g, j) { return t[metric][j]; }));
        if (sameSeries) {
          charts[i].chart.setData(data);
        } else {
          if (charts[i]) charts[i].chart.destroy();
          el.textContent = "";
          charts[i] = { chart: window.GpupoolCharts.lines(el, {
            x: t.x,
            series: t.gpus.map(function (g, j) { return { label: g.label, values: t[metric][j] }; }),
            unit: el.getAttribute("data-unit"),
            max: Number(el.getAttribute("data-max")) || null,
            places: metric === "mem" ? 1 : 0,
            sync: "workload-" + id
          }) };
        }
        el.setAttribute("data-points", String(t.x.length));
      });
      schedule(t.holding);
    }

    function refreshCharts() {
      if (!grid || !telemetryUrl) return;
      fetch(telemetryUrl, { headers: { Accept: "application/json" }, credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (t) { if (t) draw(t); })
        .catch(function () { /* the next poll or event tries again */ });
    }

    function schedule(holding) {
      if (poller) clearTimeout(poller);
      poller = holding ? setTimeout(refreshCharts, POLL_MS) : null;
    }

    function refreshLive() {
      pending = null;
      if (window.htmx && liveUrl && document.getElementById("workload-live")) {
        window.htmx.ajax("GET", liveUrl, { target: "#workload-live", swap: "outerHTML" });
      }
      refreshCharts();
    }

    document.addEventListener("gpupool:event", function (e) {
      var ev = e.detail;
      if (ev.type !== "workload.state" || String(ev.workload_id) !== id) return;
      if (!pending) pending = setTimeout(refreshLive, 150); // a burst of events: one reload
    });

    var initial = readJson("workload-telemetry");
    if (initial) draw(initial);
  }

  /* --- the list ------------------------------------------------------------------------------- */
  function workloadList(note) {
    var seen = {};
    document.addEventListener("gpupool:event", function (e) {
      var ev = e.detail;
      if (ev.type !== "workload.state" || ev.from !== "") return;
      var rows = document.getElementById("workload-rows");
      var shown = rows ? (rows.getAttribute("data-workload-ids") || "").split(",") : [];
      if (shown.indexOf(String(ev.workload_id)) !== -1 || seen[ev.workload_id]) return;
      seen[ev.workload_id] = true;
      note.querySelector("[data-new-count]").textContent = String(Object.keys(seen).length);
      note.hidden = false;
    });
  }

  function init() {
    var form = document.getElementById("launch-form");
    if (form) launchForm(form);
    document.querySelectorAll("[data-workload-page]").forEach(workloadPage);
    var note = document.querySelector("[data-new-workloads]");
    if (note) workloadList(note);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
