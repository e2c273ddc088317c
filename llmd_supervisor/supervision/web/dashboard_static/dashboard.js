// llmd-supervisor dashboard: table sorting and the live log (server-sent events).
// Everything the server sends is inserted as text (textContent, text nodes), never as HTML.
"use strict";

(function () {
  var LOG_KEEP = 2000000; // characters of log kept on the page; older text is dropped

  function cellKey(row, index, kind) {
    var cell = row.cells[index];
    if (!cell) {
      return kind === "num" ? -Infinity : "";
    }
    var raw = cell.hasAttribute("data-value") ? cell.getAttribute("data-value") : cell.textContent;
    if (kind === "num") {
      var n = parseFloat(raw);
      return isNaN(n) ? -Infinity : n;
    }
    return raw.toLowerCase();
  }

  function sortBy(table, th, index) {
    var body = table.tBodies[0];
    if (!body) {
      return;
    }
    var kind = th.getAttribute("data-sort");
    var ascending = !th.classList.contains("sorted-asc");
    var heads = table.querySelectorAll("th[data-sort]");
    for (var i = 0; i < heads.length; i++) {
      heads[i].classList.remove("sorted-asc", "sorted-desc");
    }
    th.classList.add(ascending ? "sorted-asc" : "sorted-desc");
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = cellKey(a, index, kind);
      var y = cellKey(b, index, kind);
      var order = x < y ? -1 : x > y ? 1 : 0;
      return ascending ? order : -order;
    });
    for (var j = 0; j < rows.length; j++) {
      body.appendChild(rows[j]);
    }
  }

  function sortable() {
    var tables = document.querySelectorAll("table.sortable");
    tables.forEach(function (table) {
      var heads = table.tHead ? table.tHead.rows[0].cells : [];
      Array.prototype.forEach.call(heads, function (th, index) {
        if (th.hasAttribute("data-sort")) {
          th.addEventListener("click", function () {
            sortBy(table, th, index);
          });
        }
      });
    });
  }

  function liveLog() {
    var log = document.getElementById("log");
    if (!log) {
      return;
    }
    var state = document.getElementById("log-state");
    var url = log.getAttribute("data-stream");
    var rank = new URLSearchParams(window.location.search).get("rank");
    if (rank !== null && /^[0-9]+$/.test(rank)) {
      url += "?rank=" + rank;
    }
    var lastFile = null;
    var kept = 0;
    var source = new EventSource(url);

    function say(text) {
      if (state) {
        state.textContent = text;
      }
    }

    function append(text) {
      var atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
      log.appendChild(document.createTextNode(text));
      kept += text.length;
      while (kept > LOG_KEEP && log.firstChild) {
        kept -= log.firstChild.textContent.length;
        log.removeChild(log.firstChild);
      }
      if (atEnd) {
        log.scrollTop = log.scrollHeight;
      }
    }

    source.addEventListener("open", function () {
      say("Following the log live.");
    });
    source.addEventListener("log", function (event) {
      var item = JSON.parse(event.data);
      if (item.file !== lastFile) {
        append((lastFile === null ? "" : "\n") + "==> " + item.file + " <==\n");
        lastFile = item.file;
      }
      append(item.text);
    });
    source.addEventListener("end", function (event) {
      var item = JSON.parse(event.data);
      say("The run is " + item.state + "; this is the whole log.");
      source.close();
    });
    source.addEventListener("problem", function (event) {
      say(JSON.parse(event.data).message);
      source.close();
    });
    source.addEventListener("error", function () {
      if (source.readyState !== EventSource.CLOSED) {
        say("The connection was lost; reconnecting (the log resumes where it stopped).");
      }
    });
  }

  function start() {
    sortable();
    liveLog();
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
