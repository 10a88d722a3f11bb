/* gpupool live events: one websocket per page to /ws/events/, reconnecting with backoff and jitter.
 *
 * Every event is re-dispatched on document as a "gpupool:event" CustomEvent (event.detail is the
 * JSON the server sent), so page scripts (charts.js) subscribe without opening sockets of their own.
 * This file also applies the fleet events to the markup that carries the matching data attributes:
 *
 *   [data-node-state="<node id>"]        node state badge         (node.state, fleet.snapshot)
 *   [data-node-reason="<node id>"]       node state reason        (node.state)
 *   .hm-node[data-node="<node id>"]      heat map node tile       (node.state, fleet.snapshot)
 *   [data-gpu-health="<gpu id>"]         GPU health badge         (gpu.health)
 *   [data-gpu-metric="<gpu id>:<name>"]  util / mem / power / temp (fleet.snapshot)
 *   [data-count="<key>"]                 a number                 (fleet.snapshot)
 *   [data-alert-list]                    open fleet alerts        (fleet.snapshot)
 *   [data-live-status]                   "Live" / "Reconnecting…"
 *   [data-workload-state="<id>"]         workload state badge     (workload.state)
 */
(function () {
  "use strict";
  if (window.GpupoolLive) return; // one socket per page, whatever includes this file twice

  var STATE_LABELS = {
    ready: "Ready", cordoned: "Cordoned", draining: "Draining",
    suspect: "Suspect", down: "Down", maintenance: "Maintenance"
  };
  var socket = null;
  var attempt = 0;
  var last = null; // the latest fleet.snapshot, for late subscribers

  function each(selector, fn) {
    document.querySelectorAll(selector).forEach(fn);
  }

  function status(text, state) {
    each("[data-live-status]", function (el) {
      el.textContent = text;
      el.setAttribute("data-state", state);
    });
  }

  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }

  function fmt(value, places) {
    if (value === null || value === undefined) return "–";
    var n = Number(value);
    return places ? n.toFixed(places) : String(Math.round(n));
  }

  function applyNodeState(id, state, label) {
    var text = label || STATE_LABELS[state] || state;
    each('[data-node-state="' + id + '"]', function (el) {
      var cls = "badge badge-node badge-node-" + state;
      if (el.className !== cls) el.className = cls;
      setText(el, text);
    });
    each('.hm-node[data-node="' + id + '"]', function (el) {
      el.className = el.className.replace(/\bs-[a-z]+\b/, "s-" + state);
    });
  }

  function onNodeState(ev) {
    applyNodeState(ev.node, ev.state, ev.label);
    each('[data-node-reason="' + ev.node + '"]', function (el) { setText(el, ev.reason || ""); });
  }

  function onGpuHealth(ev) {
    each('[data-gpu-health="' + ev.gpu + '"]', function (el) {
      var bad = ev.health === "unhealthy";
      el.className = "badge " + (bad ? "badge-danger" : ev.isolated ? "badge-warn" : "badge-node-ready");
      setText(el, bad ? "Unhealthy" : ev.isolated ? "Isolated" : "Healthy");
    });
  }

  function onSnapshot(ev) {
    last = ev;
    var counts = { nodes: ev.nodes.total, gpus: ev.gpus.total, util: fmt(ev.gpus.util_avg),
      "gpus:unhealthy": ev.gpus.unhealthy, "gpus:isolated": ev.gpus.isolated,
      alerts: ev.alerts.length, unknown: ev.unknown_gpus };
    Object.keys(ev.nodes.by_state).forEach(function (s) { counts["state:" + s] = ev.nodes.by_state[s]; });
    Object.keys(ev.nodes.by_region).forEach(function (code) {
      var states = ev.nodes.by_region[code];
      Object.keys(STATE_LABELS).forEach(function (s) { counts["region:" + code + ":" + s] = states[s] || 0; });
    });
    each("[data-count]", function (el) {
      var key = el.getAttribute("data-count");
      if (!(key in counts)) return;
      var value = counts[key];
      setText(el, typeof value === "number" ? value.toLocaleString("en-US") : String(value));
      el.classList.toggle("zero", value === 0);
    });

    // node states: every node not listed is ready
    var stateOf = {};
    Object.keys(ev.not_ready).forEach(function (s) {
      ev.not_ready[s].forEach(function (id) { stateOf[id] = s; });
    });
    each("[data-node-state]", function (el) {
      var state = stateOf[el.getAttribute("data-node-state")] || "ready";
      var cls = "badge badge-node badge-node-" + state;
      if (el.className !== cls) {
        el.className = cls;
        setText(el, STATE_LABELS[state] || state);
      }
    });
    each(".hm-node[data-node]", function (el) {
      var state = stateOf[el.getAttribute("data-node")] || "ready";
      if (!el.classList.contains("s-" + state)) el.className = el.className.replace(/\bs-[a-z]+\b/, "s-" + state);
    });

    // the GPU table of a node page
    var metrics = document.querySelectorAll("[data-gpu-metric]");
    if (metrics.length) {
      var rows = {};
      ev.g.forEach(function (r) { rows[r[0]] = r; });
      metrics.forEach(function (el) {
        var parts = el.getAttribute("data-gpu-metric").split(":");
        var r = rows[parts[0]];
        if (!r) return;
        var text = { util: fmt(r[1]) + " %", mem: fmt(r[2], 1) + " GiB", power: fmt(r[3]) + " W", temp: fmt(r[4]) + " °C" }[parts[1]];
        setText(el, r[1] === null ? "–" : text);
      });
    }

    // alerts
    var card = document.getElementById("fleet-alerts");
    var list = document.querySelector("[data-alert-list]");
    if (card && list) {
      card.hidden = ev.alerts.length === 0;
      list.textContent = "";
      ev.alerts.forEach(function (a) {
        var li = document.createElement("li");
        var strong = document.createElement("strong");
        strong.textContent = a.kind === "mass_silence" ? "A large share of the fleet went silent" : a.kind;
        var p = document.createElement("p");
        p.textContent = a.message;
        li.appendChild(strong);
        li.appendChild(p);
        list.appendChild(li);
      });
    }
  }

  var WORKLOAD_LABELS = {
    pending: "Pending", queued: "Queued", scheduled: "Scheduled", starting: "Starting", running: "Running",
    stopping: "Stopping", preempted: "Preempted", stopped: "Stopped", succeeded: "Succeeded", failed: "Failed"
  };

  function onWorkloadState(ev) {
    each('[data-workload-state="' + ev.workload_id + '"]', function (el) {
      var cls = "badge badge-wl badge-wl-" + ev.to;
      if (el.className !== cls) el.className = cls;
      setText(el, WORKLOAD_LABELS[ev.to] || ev.to);
    });
  }

  var handlers = { "fleet.snapshot": onSnapshot, "node.state": onNodeState, "gpu.health": onGpuHealth,
    "workload.state": onWorkloadState };

  function receive(ev) {
    if (!ev || typeof ev.type !== "string") return;
    if (handlers[ev.type]) {
      try { handlers[ev.type](ev); } catch (e) { if (window.console) console.error(e); }
    }
    document.dispatchEvent(new CustomEvent("gpupool:event", { detail: ev }));
  }

  function connect() {
    var url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws/events/";
    try {
      socket = new WebSocket(url);
    } catch (e) {
      retry();
      return;
    }
    socket.onopen = function () {
      attempt = 0;
      status("Live", "open");
    };
    socket.onmessage = function (message) {
      var ev;
      try { ev = JSON.parse(message.data); } catch (e) { return; }
      receive(ev);
    };
    socket.onclose = function (event) {
      socket = null;
      if (event.code === 4401 || event.code === 4403) {
        status("Live updates off", "closed"); // signed out, or nothing to receive: do not hammer
        return;
      }
      retry();
    };
  }

  function retry() {
    // 1 s, 2 s, 4 s ... capped at 30 s, with jitter so that a restarted server is not stampeded
    var delay = Math.min(30000, 1000 * Math.pow(2, attempt)) * (0.5 + Math.random() / 2);
    attempt += 1;
    status("Reconnecting…", "retry");
    setTimeout(connect, delay);
  }

  window.GpupoolLive = {
    latest: function () { return last; },
    receive: receive // for tests and for the initial data a page embeds
  };

  window.addEventListener("pagehide", function () { if (socket) socket.close(1000); });
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", connect);
  else connect();
})();
