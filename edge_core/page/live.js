// edge serve's page, live part: polls /edge/memory and vLLM's /metrics, draws measured vs predicted.
(function () {
  "use strict";
  var POLL_MS = 2000, WINDOW_S = 300, MIN_SPAN_S = 60, H = 260, L = 64, R = 10, T = 12, B = 26;
  var section = document.getElementById("live");
  var plan = JSON.parse(section.getAttribute("data-plan"));
  var key = new URLSearchParams(location.search).get("key");
  var headers = key ? {Authorization: "Bearer " + key} : {};
  var points = [], firstOver = null, lastTokens = null, svg = document.getElementById("chart");
  var NS = "http://www.w3.org/2000/svg";

  function mib(b) {
    if (b === null || b === undefined) return "\u2013";
    return (b / 1048576).toLocaleString("en-US", {minimumFractionDigits: 1, maximumFractionDigits: 1}) + " MiB";
  }
  function set(id, text) { document.getElementById(id).textContent = text; }
  function el(name, attrs, text) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (text !== undefined) node.textContent = text;
    svg.appendChild(node);
    return node;
  }
  function metric(text, name) {  // sum of every sample of one Prometheus series, or null when absent
    var total = null, lines = text.split("\n");
    for (var i = 0; i < lines.length; i++) {
      var line = lines[i];
      if (line.charAt(0) === "#" || line.lastIndexOf(name, 0) !== 0) continue;
      var rest = line.charAt(name.length);
      if (rest !== "{" && rest !== " ") continue;
      var value = parseFloat(line.slice(line.lastIndexOf(" ") + 1));
      if (!isNaN(value)) total = (total || 0) + value;
    }
    return total;
  }

  function draw(now) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var W = Math.max(svg.clientWidth || 640, 240);  // drawn in CSS pixels: text stays 11 px on any window
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    // The last minute to the last five: as much time as there are readings.
    var span = Math.min(WINDOW_S, Math.max(MIN_SPAN_S, points.length ? now - points[0].t : 0));
    var step = span > 150 ? 60 : span > 90 ? 30 : 15;
    var top = Math.max(plan.admission || 0, plan.predicted || 0);
    points.forEach(function (p) { top = Math.max(top, p.peak || 0, p.now || 0); });
    top = top * 1.08 || 1;
    var x = function (t) { return L + (W - L - R) * (1 - (now - t) / span); };
    var y = function (b) { return T + (H - T - B) * (1 - Math.max(b, 0) / top); };
    for (var i = 0; i <= 4; i++) {
      var b = top * i / 4;
      el("line", {"class": "grid", x1: L, x2: W - R, y1: y(b), y2: y(b)});
      el("text", {x: L - 4, y: y(b) + 4, "text-anchor": "end"}, (b / 1048576).toLocaleString("en-US", {maximumFractionDigits: 0}) + " MiB");
    }
    for (var ago = 0; ago <= span; ago += step) {
      var label = ago === 0 ? "now" : "\u2212" + (ago % 60 ? ago + " s" : ago / 60 + " min");
      el("text", {x: x(now - ago), y: H - 8, "text-anchor": ago === 0 ? "end" : "middle"}, label);
    }
    if (plan.admission) el("line", {"class": "admit", x1: L, x2: W - R, y1: y(plan.admission), y2: y(plan.admission)});
    if (plan.predicted) {
      el("line", {"class": "pred", x1: L, x2: W - R, y1: y(plan.predicted), y2: y(plan.predicted)});
      el("text", {x: W - R - 2, y: y(plan.predicted) - 4, "text-anchor": "end"}, "predicted " + mib(plan.predicted));
    }
    var shown = points.filter(function (p) { return now - p.t <= span; });
    function line(cls, value) {
      var xy = shown.filter(function (p) { return value(p) !== null; })
        .map(function (p) { return x(p.t).toFixed(1) + "," + y(value(p)).toFixed(1); });
      if (xy.length) el("polyline", {"class": cls, points: xy.join(" ")});
      return xy.length;
    }
    line("peakline", function (p) { return p.peak; });
    var ranks = shown.length && shown[shown.length - 1].ranks ? shown[shown.length - 1].ranks.length : 0;
    for (var r = 0; r < ranks; r++) {
      var at = shown[shown.length - 1].ranks[r];
      line("rank", function (p) { return p.ranks && p.ranks[r] ? p.ranks[r].pss_bytes : null; });
      el("text", {x: W - R - 2, y: y(at.pss_bytes) + 12, "text-anchor": "end"}, "rank " + at.rank);
    }
    svg.setAttribute("data-points", line("now", function (p) { return p.now; }));
    if (firstOver && now - firstOver.t <= span) {
      el("line", {"class": "over", x1: x(firstOver.t), x2: x(firstOver.t), y1: T, y2: H - B});
      el("circle", {"class": "overdot", cx: x(firstOver.t), cy: y(firstOver.peak), r: 4});
      var right = x(firstOver.t) > W / 2;  // the label on the side with room
      el("text", {x: x(firstOver.t) + (right ? -4 : 4), y: T + 10, "text-anchor": right ? "end" : "start"},
         "first over prediction " + firstOver.at);
    }
  }

  function memory(doc, now) {
    if (doc.schema !== "edge.memory") throw new Error("unexpected document " + doc.schema);
    plan.predicted = doc.predicted_peak_bytes;
    var point = {t: now, now: doc.measured_current_bytes, peak: doc.measured_peak_bytes, ranks: doc.ranks || null};
    points.push(point);
    while (points.length && now - points[0].t > WINDOW_S) points.shift();
    set("m-current", mib(doc.measured_current_bytes));
    set("m-peak", mib(doc.measured_peak_bytes));
    set("m-predicted", mib(doc.predicted_peak_bytes));
    set("m-ratio", doc.ratio === null ? "\u2013" : doc.ratio.toFixed(3) + "\u00d7");
    set("m-exceeded", String(doc.exceeded_count));
    set("counter", doc.counter + ", " + doc.samples + " samples");
    set("m-ranks", (doc.ranks || []).map(function (r) {
      return "rank " + r.rank + " (pid " + r.pid + "): " + mib(r.pss_bytes);
    }).join(" \u00b7 "));
    var status = document.getElementById("status");
    if (!firstOver && doc.measured_peak_bytes > doc.predicted_peak_bytes) {
      var before = points.length === 1 && doc.exceeded_count > 1;
      firstOver = {t: now, peak: doc.measured_peak_bytes,
                   at: new Date().toLocaleTimeString() + (before ? " (or before this page opened)" : "")};
    }
    if (firstOver) {
      status.className = "over";
      status.textContent = "measured peak " + mib(doc.measured_peak_bytes) + " exceeds the predicted " +
        mib(doc.predicted_peak_bytes) + " (first seen " + firstOver.at + "): the plan under-predicted this session";
    } else {
      status.className = "";
      status.textContent = "within the prediction; updated " + new Date().toLocaleTimeString();
    }
  }

  function engine(text, now) {
    var running = metric(text, "vllm:num_requests_running"), waiting = metric(text, "vllm:num_requests_waiting");
    var tokens = metric(text, "vllm:generation_tokens_total");
    var usage = metric(text, "vllm:kv_cache_usage_perc");  // a fraction of the pool, 0..1 (vLLM's gauge)
    set("m-running", running === null ? "\u2013" : String(running));
    set("m-waiting", waiting === null ? "\u2013" : String(waiting));
    set("m-kv", usage === null ? "\u2013" : (100 * usage).toFixed(1) + "% of " + mib(plan.kv_pool) +
        (plan.kv_sequences ? " (holds " + plan.kv_sequences + " at full context)" : ""));
    if (tokens !== null && lastTokens && now > lastTokens.t) {
      set("m-tps", ((tokens - lastTokens.v) / (now - lastTokens.t)).toFixed(1) + " tok/s");
    }
    if (tokens !== null) lastTokens = {t: now, v: tokens};
  }

  function poll() {
    var now = Date.now() / 1000;
    Promise.all([
      fetch("/edge/memory", {headers: headers, cache: "no-store"}).then(function (r) {
        if (!r.ok) throw new Error("/edge/memory answered " + r.status);
        return r.json();
      }).then(function (doc) { memory(doc, now); }),
      fetch("/metrics", {headers: headers, cache: "no-store"}).then(function (r) {
        return r.ok ? r.text() : "";
      }).then(function (text) { engine(text, now); })
    ]).catch(function (error) {
      var status = document.getElementById("status");
      status.className = "over";
      status.textContent = "the server did not answer (" + error.message + "); retrying";
    }).then(function () { draw(now); setTimeout(poll, POLL_MS); });
  }
  poll();
})();
