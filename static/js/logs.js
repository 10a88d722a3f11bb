/* gpupool workload output: the workload page's live log view.
 *
 *   [data-log-view]     data-log-url: the API's logs URL. Follows it as an EventSource
 *                       (?follow=1, the last 500 lines first), appending each line.
 *   [data-log-pause]    Pause closes the stream (the view stays as it is); Resume opens it again
 *                       after the last line shown (since=), so nothing is missed.
 *   [data-log-search]   shows only the lines that contain the text (case-insensitive).
 *   [data-log-status]   Following / Paused / Reconnecting.
 * Lines are text nodes (never HTML); stderr lines get the class log-stderr. The view keeps at most
 * MAX_LINES; Download (a plain link) gives the whole retained log.
 */
(function () {
  "use strict";

  var MAX_LINES = 5000;

  function logView(root) {
    var url = root.getAttribute("data-log-url");
    var out = root.querySelector("[data-log-lines]");
    var pause = root.querySelector("[data-log-pause]");
    var search = root.querySelector("[data-log-search]");
    var status = root.querySelector("[data-log-status]");
    var source = null;
    var last = null;
    var paused = false;

    function matches(line) {
      var q = search.value.trim().toLowerCase();
      return !q || line.textContent.toLowerCase().indexOf(q) !== -1;
    }

    function append(id, line) {
      var el = document.createElement("span");
      el.className = "log-line" + (line.stream === "stderr" ? " log-stderr" : "");
      el.textContent = line.at.replace("T", " ").replace("Z", "") + "  " + line.text + "\n";
      el.hidden = !matches(el);
      var atBottom = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
      out.appendChild(el);
      while (out.childNodes.length > MAX_LINES) out.removeChild(out.firstChild);
      if (atBottom) out.scrollTop = out.scrollHeight;
      last = id;
    }

    function open() {
      var query = last === null ? "follow=1&tail=500" : "follow=1&since=" + encodeURIComponent(last);
      source = new EventSource(url + "?" + query);
      source.onopen = function () { status.textContent = "Following"; };
      source.onmessage = function (event) {
        try { append(event.lastEventId, JSON.parse(event.data)); } catch (e) { /* not a line */ }
      };
      source.onerror = function () {
        if (!paused) status.textContent = "Reconnecting…";
      };
    }

    function close() {
      if (source) { source.close(); source = null; }
    }

    pause.addEventListener("click", function () {
      paused = !paused;
      pause.setAttribute("aria-pressed", paused ? "true" : "false");
      pause.textContent = paused ? "Resume" : "Pause";
      if (paused) { close(); status.textContent = "Paused"; } else { open(); }
    });
    search.addEventListener("input", function () {
      out.querySelectorAll(".log-line").forEach(function (el) { el.hidden = !matches(el); });
    });
    window.addEventListener("pagehide", close);
    open();
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-log-view]").forEach(logView);
  });
})();
