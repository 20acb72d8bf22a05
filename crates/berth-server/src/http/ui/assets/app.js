// berth web UI: live updates only; every page is complete without this script.
//
// A live page's <main> names an event filter (data-live) and the newest event id before the
// page read its data (data-cursor). The script follows /api/v1/events from that cursor with
// the session cookie; on each event it fetches the same page again and swaps in the new <main>,
// so the server renders everything and nothing here builds HTML from event data. The browser's
// EventSource reconnects by itself and sends Last-Event-ID, so a server restart loses nothing.
(function () {
  "use strict";

  var main = document.getElementById("main");
  if (!main || !main.hasAttribute("data-live")) {
    return;
  }
  var status = document.querySelector(".live-status");
  var filter = main.getAttribute("data-live");
  var cursor = main.getAttribute("data-cursor") || "0";
  var query = "after=" + encodeURIComponent(cursor) + (filter ? "&" + filter : "");
  var timer = null;
  var busy = false;
  var again = false;

  function say(text) {
    if (!status) {
      return;
    }
    status.textContent = text;
    status.hidden = text === "";
  }

  // A user typing in a form on the page keeps their input: the swap waits for them to leave.
  function editing() {
    var active = document.activeElement;
    return active && main.contains(active) && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName);
  }

  function refresh() {
    timer = null;
    if (busy || editing()) {
      again = true;
      return;
    }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (response) {
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        return response.text();
      })
      .then(function (text) {
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.getElementById("main");
        if (fresh) {
          main.replaceChildren.apply(main, Array.prototype.slice.call(fresh.childNodes));
          main.setAttribute("data-updated", String(Date.now()));
        }
        say("");
      })
      .catch(function () {
        say("Live updates paused; reload the page.");
      })
      .then(function () {
        busy = false;
        if (again) {
          again = false;
          schedule();
        }
      });
  }

  // Events come in bursts (a deployment moves many targets); one re-render per 150 ms is enough.
  function schedule() {
    if (timer === null) {
      timer = window.setTimeout(refresh, 150);
    }
  }

  document.addEventListener("focusout", function () {
    if (again && !busy) {
      again = false;
      schedule();
    }
  });

  // How many events arrived and the last id, on <main>: what a reader (or the browser tests)
  // checks to see that a reconnect resumed where the stream stopped.
  var received = 0;
  function onEvent(event) {
    received += 1;
    main.setAttribute("data-events", String(received));
    if (event.lastEventId) {
      main.setAttribute("data-last-event", event.lastEventId);
    }
    schedule();
  }

  var source = new EventSource("/api/v1/events?" + query);
  source.onmessage = onEvent;
  ["task.state", "agent.registered", "agent.status", "agent.deleted", "agent.hold",
   "deployment.state", "deployment.target", "deployment.approval",
   "environment.drift", "environment.readiness"].forEach(function (kind) {
    source.addEventListener(kind, onEvent);
  });
  source.onopen = function () {
    main.setAttribute("data-stream", "open");
    say("");
  };
  source.onerror = function () {
    main.setAttribute("data-stream", "reconnecting");
    say("Reconnecting to live updates…");
  };
})();
