/* gpupool web shell: small behaviours on top of htmx. No framework, no build step. */
(function () {
  "use strict";

  function toast(text, kind) {
    var box = document.getElementById("toasts");
    if (!box || !text) return;
    var item = document.createElement("div");
    item.className = "flash flash-" + (kind || "error");
    item.setAttribute("role", "alert");
    var span = document.createElement("span");
    span.textContent = text;
    item.appendChild(span);
    box.appendChild(item);
    setTimeout(function () { item.remove(); }, 7000);
  }

  function messageOf(xhr) {
    var header = xhr && xhr.getResponseHeader("X-Gpupool-Message");
    if (header) {
      try { return decodeURIComponent(header); } catch (e) { return header; }
    }
    if (!xhr || xhr.status === 0) return "The server could not be reached. Check your connection.";
    if (xhr.status === 404) return "That no longer exists. Reload the page.";
    if (xhr.status === 403) return "You are not allowed to do that.";
    return "Something went wrong (" + xhr.status + "). Try again.";
  }

  function syncExpiry(root) {
    (root || document).querySelectorAll("select[name=expiry]").forEach(function (select) {
      var form = select.form;
      var box = form && form.querySelector(".expiry-date");
      if (box) box.hidden = select.value !== "date";
    });
  }

  // Bars (meters, progress) carry their percentage in data-bar: the Content-Security-Policy allows
  // no style attribute in markup, but a width set from script is allowed.
  function drawBars(root) {
    (root || document).querySelectorAll("[data-bar]").forEach(function (bar) {
      var pct = parseFloat(bar.getAttribute("data-bar"));
      bar.style.width = (isFinite(pct) ? Math.min(100, Math.max(0, pct)) : 0) + "%";
    });
  }

  function autoDismiss(root) {
    (root || document).querySelectorAll("#messages .flash").forEach(function (flash) {
      if (flash.dataset.timer) return;
      flash.dataset.timer = "1";
      setTimeout(function () { flash.remove(); }, 6000);
    });
  }

  document.addEventListener("click", function (event) {
    var copy = event.target.closest("[data-copy]");
    if (copy) {
      var input = document.querySelector(copy.getAttribute("data-copy"));
      var label = copy.querySelector("[data-copy-label]") || copy;
      var done = function () {
        label.textContent = "Copied";
        copy.classList.add("copied");
        setTimeout(function () { label.textContent = "Copy"; copy.classList.remove("copied"); }, 2000);
      };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(input.value).then(done, function () { input.select(); });
      } else {
        input.select();
        try { document.execCommand("copy"); done(); } catch (e) { /* the text stays selected */ }
      }
      return;
    }
    var dismiss = event.target.closest("[data-dismiss]");
    if (dismiss) dismiss.closest(".flash").remove();
  });

  document.addEventListener("focusin", function (event) {
    if (event.target.matches("[data-select-on-focus]")) event.target.select();
  });

  document.addEventListener("change", function (event) {
    if (event.target.matches("select[name=expiry]")) syncExpiry(event.target.form);
  });

  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
    document.querySelectorAll("details.user-menu[open]").forEach(function (d) { d.open = false; });
  });

  document.addEventListener("htmx:responseError", function (event) {
    var target = event.detail.target;
    if (target && target.classList.contains("panel-body")) {
      target.removeAttribute("aria-busy");
      target.innerHTML = '<p class="muted small">This panel could not be loaded.</p>';
      return;
    }
    toast(messageOf(event.detail.xhr), "error");
  });

  document.addEventListener("htmx:sendError", function () {
    toast("The server could not be reached. Check your connection.", "error");
  });

  document.addEventListener("htmx:afterSwap", function (event) {
    var target = event.detail.target;
    if (target && target.removeAttribute) target.removeAttribute("aria-busy");
  });

  document.addEventListener("htmx:load", function (event) {
    syncExpiry(event.detail.elt.parentNode || document);
    drawBars(event.detail.elt.parentNode || document);
    autoDismiss(document);
  });

  document.addEventListener("DOMContentLoaded", function () {
    syncExpiry(document);
    drawBars(document);
    autoDismiss(document);
  });
})();
