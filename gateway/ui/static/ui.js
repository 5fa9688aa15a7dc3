// Ferry's live page: polls /ui/stats every second and draws it; changes knobs through the
// admin API (PATCH /admin/models/{model}/batching) with the token typed into the page.
// The token lives in one variable of this script: never stored, never sent anywhere else.
// Every name and value reaches the page through textContent or an attribute, never innerHTML.
"use strict";

(function () {
  const POLL_MS = 1000;
  const KEEP = 300; // points per time chart (5 minutes at one a second)
  const KEEP_OBSERVED = 120; // observed batches per cost chart
  const COLORS = ["#1f6feb", "#e8590c", "#2e7d32", "#8e24aa", "#c62828", "#00838f"];

  let token = ""; // page memory only
  let admin = false;
  let specs = [];
  const views = new Map(); // model name -> view

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }

  function fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    if (typeof x !== "number") return String(x);
    const d = digits === undefined ? (Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 2) : digits;
    return x.toFixed(d);
  }

  function show(v) {
    return v === null || v === undefined ? "none" : String(v);
  }

  // A vertical line at each knob change, so before and after can be compared.
  function marksPlugin(view) {
    return {
      hooks: {
        draw: [
          (u) => {
            const ctx = u.ctx;
            ctx.save();
            ctx.strokeStyle = "#c62828";
            ctx.setLineDash([4, 4]);
            ctx.lineWidth = 1.5 * devicePixelRatio;
            for (const m of view.marks) {
              const x = Math.round(u.valToPos(m.t, "x", true));
              if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
              ctx.beginPath();
              ctx.moveTo(x, u.bbox.top);
              ctx.lineTo(x, u.bbox.top + u.bbox.height);
              ctx.stroke();
            }
            ctx.restore();
          },
        ],
      },
    };
  }

  function chartWidth(holder) {
    return Math.max(260, Math.floor(holder.clientWidth) - 8); // the grid cell's width
  }

  function timeChart(view, box, title, labels, unit) {
    const holder = el("div", { class: "chart", "data-chart": title, "data-points": "0", "data-marks": "0" }, el("h3", {}, title));
    box.append(holder);
    const series = [{}].concat(
      labels.map((label, i) => ({ label: label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false })),
    );
    const opts = {
      width: chartWidth(holder),
      height: 190,
      series: series,
      scales: { x: { time: true } },
      axes: [{}, { label: unit, size: 50 }],
      legend: { live: false },
      plugins: [marksPlugin(view)],
    };
    const data = [[]].concat(labels.map(() => []));
    const plot = new uPlot(opts, data, holder);
    return { holder: holder, plot: plot, data: data };
  }

  function push(chart, t, values) {
    chart.data[0].push(t);
    values.forEach((v, i) => chart.data[i + 1].push(v === undefined ? null : v));
    if (chart.data[0].length > KEEP) chart.data.forEach((s) => s.shift());
    chart.plot.setData(chart.data);
    chart.holder.setAttribute("data-points", String(chart.data[0].length));
  }

  function costChart(box) {
    const holder = el("div", { class: "chart", "data-chart": "cost", "data-points": "0" },
      el("h3", {}, "Cost model: predicted batch time vs batch size (line), observed batches (points)"));
    box.append(holder);
    const plot = new uPlot(
      {
        width: chartWidth(holder),
        height: 190,
        series: [{ label: "items" }],
        scales: { x: { time: false } },
        axes: [{ label: "items per batch" }, { label: "ms", size: 50 }],
        legend: { live: false },
      },
      [[]],
      holder,
    );
    return { holder: holder, plot: plot, phases: [], observed: {} };
  }

  function drawCost(chart, cost) {
    const phases = Object.keys(cost).sort();
    for (const ph of phases) {
      const o = cost[ph].observed;
      if (!chart.observed[ph]) chart.observed[ph] = [];
      if (o && o.batches > 0) {
        chart.observed[ph].push([o.items, o.ms]);
        if (chart.observed[ph].length > KEEP_OBSERVED) chart.observed[ph].shift();
      }
    }
    if (phases.join() !== chart.phases.join()) {
      // The series change with the phases: rebuild them (rare: once, when the fit appears).
      while (chart.plot.series.length > 1) chart.plot.delSeries(1);
      phases.forEach((ph, i) => {
        chart.plot.addSeries({ label: ph + " predicted", stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true });
        chart.plot.addSeries({
          label: ph + " observed",
          stroke: COLORS[i % COLORS.length],
          width: 0,
          paths: () => null,
          points: { show: true, size: 6, fill: COLORS[i % COLORS.length] },
        });
      });
      chart.phases = phases;
    }
    // uPlot shares one x array: one row per point (predicted or observed), ascending in x
    // (equal sizes may repeat), each row holding the value of its own series only.
    const rows = [];
    let points = 0;
    phases.forEach((ph, i) => {
      cost[ph].predicted.forEach((p) => rows.push([p[0], 2 * i, p[1]]));
      chart.observed[ph].forEach((p) => rows.push([p[0], 2 * i + 1, p[1]]));
      points += chart.observed[ph].length;
    });
    rows.sort((a, b) => a[0] - b[0]);
    const data = [rows.map((r) => r[0])];
    for (let k = 0; k < 2 * phases.length; k++) data.push(rows.map((r) => (r[1] === k ? r[2] : null)));
    chart.plot.setData(data);
    chart.holder.setAttribute("data-points", String(points));
  }

  function table(panel, rows) {
    const body = el("tbody");
    for (const row of rows) body.append(el("tr", {}, ...row.map((c, i) => el("td", { class: i ? "num" : "" }, c))));
    panel.replaceChildren(panel.firstChild, el("table", {}, body));
  }

  function bars(panel, dist) {
    const body = el("tbody");
    for (const [phase, buckets] of Object.entries(dist)) {
      const total = buckets.reduce((s, b) => s + b.count, 0);
      body.append(el("tr", {}, el("th", { colspan: "3" }, phase)));
      for (const b of buckets) {
        if (b.count <= 0) continue;
        const bar = el("div", { class: "bar" });
        bar.style.width = (100 * b.count) / Math.max(total, 1) + "%"; // CSSOM: allowed by the CSP
        body.append(el("tr", {}, el("td", {}, "≤ " + b.le), el("td", { class: "barcell" }, bar), el("td", { class: "num" }, fmt(b.count, 0))));
      }
    }
    if (!body.firstChild) body.append(el("tr", {}, el("td", {}, "no batches in the window")));
    panel.replaceChildren(panel.firstChild, el("table", { class: "bars" }, body));
  }

  function knobForm(view, box) {
    const panel = el("div", { class: "panel knob-panel" }, el("h3", {}, "Knobs"));
    const grid = el("div", { class: "knobs" });
    view.inputs = {};
    for (const s of specs) {
      let input;
      if (s.choices) {
        input = el("select", { name: s.name });
        for (const c of s.choices) input.append(el("option", { value: c }, c));
      } else {
        input = el("input", { name: s.name, type: "text", inputmode: "decimal" });
        if (s.nullable) input.setAttribute("placeholder", "empty: " + (s.null || "none"));
      }
      input.disabled = true;
      input.title = s.help + (s.unit ? " (" + s.unit + ")" : "");
      input.addEventListener("input", () => { view.dirty.add(s.name); });
      grid.append(el("label", {}, s.name + (s.unit ? " (" + s.unit + ")" : "")), input);
      view.inputs[s.name] = input;
    }
    const apply = el("button", { type: "button", class: "apply" }, "Apply");
    apply.disabled = true;
    const message = el("span", { class: "message" });
    apply.addEventListener("click", () => applyKnobs(view));
    panel.append(grid, el("div", { class: "actions" }, apply, message));
    view.apply = apply;
    view.message = message;
    box.append(panel);
  }

  function say(view, text, kind) {
    view.message.textContent = text;
    view.message.className = "message " + (kind || "");
  }

  async function applyKnobs(view) {
    const changes = {};
    for (const s of specs) {
      if (!view.dirty.has(s.name)) continue;
      const raw = view.inputs[s.name].value.trim();
      let value;
      if (s.choices) value = raw;
      else if (raw === "" && s.nullable) value = null;
      else {
        value = Number(raw);
        if (raw === "" || !Number.isFinite(value)) {
          say(view, s.name + ": not a number", "error");
          return;
        }
      }
      changes[s.name] = value;
    }
    if (Object.keys(changes).length === 0) {
      say(view, "nothing changed", "");
      return;
    }
    say(view, "applying…", "");
    let response;
    try {
      response = await fetch("/admin/models/" + encodeURIComponent(view.name) + "/batching", {
        method: "PATCH",
        headers: { "Content-Type": "application/json", Authorization: "Bearer " + token },
        body: JSON.stringify(changes),
        credentials: "omit",
        cache: "no-store",
      });
    } catch (e) {
      say(view, "could not reach the server", "error");
      return;
    }
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (response.ok) {
      view.dirty.clear();
      say(view, "applied: " + Object.keys(changes).join(", "), "ok");
      return;
    }
    const detail = body && body.error && body.error.message ? body.error.message : response.statusText;
    if (response.status === 401) say(view, "401: " + detail + " (check the admin token)", "error");
    else if (response.status === 404) say(view, "404: " + detail + " (admin API off: start with --admin-token)", "error");
    else say(view, response.status + ": " + detail, "error");
  }

  function createView(model) {
    const view = { name: model.name, marks: [], dirty: new Set(), lastChanges: null, lastKnobs: null };
    const section = el("section", { class: "model" });
    section.dataset.model = model.name; // an attribute value, never markup
    section.append(el("h2", {}, el("span", { class: "model-name" }, model.name), el("span", { class: "kind" }, model.kind)));
    document.getElementById("models").append(section); // first: the charts size to their cells
    const charts = el("div", { class: "charts" });
    section.append(charts);
    view.rates = timeChart(view, charts, "Arrivals and completions", ["arrivals/s", "completions/s"], "per s");
    view.latencyLabels = model.kind === "chat"
      ? ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
      : ["request p50", "request p99", "queue wait p50", "queue wait p99"];
    view.latency = timeChart(view, charts, "Latency (last 10 s)", view.latencyLabels, "ms");
    view.queue = timeChart(view, charts, "Queue", model.kind === "chat" ? ["queued", "running"] : ["queued"], "items");
    view.cost = costChart(charts);
    const panels = el("div", { class: "panels" });
    section.append(panels);
    const panel = (title) => { const p = el("div", { class: "panel" }, el("h3", {}, title)); panels.append(p); return p; };
    view.sizes = panel("Batch sizes (last 10 s)");
    view.dispatch = panel("Dispatch reasons (last 10 s)");
    view.refusals = panel("Rejections and expiries (last 10 s)");
    view.slo = panel("SLO attainment (last 10 s)");
    view.tokens = panel("Batch tokens and padding (last 10 s)");
    if (model.kind === "chat") view.prefix = panel("Prefix cache and KV (last 10 s)");
    view.tenants = panel("Tenants (last 10 s)");
    knobForm(view, panels);
    const marksPanel = panel("Knob changes (dashed lines on the charts)");
    view.marksList = el("ol", { class: "marks" });
    marksPanel.append(view.marksList);
    views.set(model.name, view);
    return view;
  }

  function knobDiff(before, after) {
    const parts = [];
    for (const s of specs) {
      if (before && after && before[s.name] !== after[s.name]) {
        parts.push(s.name + " " + show(before[s.name]) + " → " + show(after[s.name]));
      }
    }
    return parts.join(", ") || "settings changed";
  }

  function update(view, model, t) {
    const rate = model.rates;
    push(view.rates, t, [rate.arrivals, rate.completions]);
    const lat = model.latency;
    const pick = (h, q) => (h ? h[q] : null);
    const series = model.kind === "chat"
      ? [pick(lat.ttft, "p50_ms"), pick(lat.ttft, "p99_ms"), pick(lat.itl, "p50_ms"), pick(lat.itl, "p99_ms")]
      : [pick(lat.request, "p50_ms"), pick(lat.request, "p99_ms"), pick(lat.queue_wait, "p50_ms"), pick(lat.queue_wait, "p99_ms")];
    push(view.latency, t, series);
    push(view.queue, t, model.kind === "chat" ? [model.queue.depth, model.queue.running] : [model.queue.depth]);
    drawCost(view.cost, model.cost);
    bars(view.sizes, model.batch_sizes);
    table(view.dispatch, Object.entries(model.dispatch).map(([k, v]) => [k, fmt(v, 0)]));
    table(view.refusals, Object.entries(model.rejections).map(([k, v]) => ["rejected: " + k, fmt(v, 0)])
      .concat(Object.entries(model.expired).map(([k, v]) => ["expired: " + k, fmt(v, 0)])));
    table(view.slo, Object.entries(model.slo).map(([k, v]) => [
      k, v.attainment === null ? "–" : fmt(100 * v.attainment, 1) + " %", fmt(v.met, 0) + " met", fmt(v.missed, 0) + " missed",
    ]));
    table(view.tokens, Object.entries(model.tokens || {}).filter(([, v]) => v.batches > 0).map(([phase, v]) => [
      phase, fmt(v.tokens_per_batch, 0) + " tokens/batch",
      v.padding === null ? "–" : fmt(100 * v.padding, 1) + " % padding",
    ]));
    if (view.prefix && model.prefix_cache) {
      const pc = model.prefix_cache;
      table(view.prefix, [
        ["hit rate", pc.hit_rate === null ? "–" : fmt(100 * pc.hit_rate, 1) + " %"],
        ["prompt tokens", fmt(pc.queries, 0)],
        ["from the cache", fmt(pc.hits, 0)],
      ].concat(model.kv ? [
        ["KV in use", model.kv.usage === null || model.kv.usage === undefined ? "–" : fmt(100 * model.kv.usage, 1) + " %"],
        ["preemptions", fmt(model.kv.preemptions, 0)],
      ] : []).concat(model.speculation && model.speculation.drafted > 0 ? [
        ["drafts taken", fmt(100 * model.speculation.acceptance, 1) + " %"],
        ["steps that drafted", model.speculation.steps_share === null ? "–" : fmt(100 * model.speculation.steps_share, 1) + " %"],
      ] : []));
    }
    if (model.tenants) {
      const tn = model.tenants;
      table(view.tenants, [["fairness (Jain)", tn.fairness === null ? "–" : fmt(tn.fairness, 3)]].concat(
        Object.entries(tn.by_tenant).map(([name, v]) => [
          name, fmt(v.input_per_s, 0) + " in/s", fmt(v.output_per_s, 0) + " out/s",
          fmt(v.queued, 0) + " queued", fmt(v.refused, 0) + " refused",
        ])));
    }
    // A change (from this page or anyone else's PATCH) shows as a mark on every time chart.
    if (view.lastChanges !== null && model.config_changes > view.lastChanges) {
      const text = knobDiff(view.lastKnobs, model.knobs);
      view.marks.push({ t: t, text: text });
      const when = new Date(t * 1000).toLocaleTimeString();
      view.marksList.append(el("li", { class: "mark" }, when + ": " + text));
      for (const c of [view.rates, view.latency, view.queue]) {
        c.plot.redraw(false);
        c.holder.setAttribute("data-marks", String(view.marks.length));
      }
    }
    view.lastChanges = model.config_changes;
    view.lastKnobs = model.knobs;
    const editable = admin && token !== "";
    for (const s of specs) {
      const input = view.inputs[s.name];
      input.disabled = !editable;
      if (!view.dirty.has(s.name) && document.activeElement !== input) {
        const v = model.knobs[s.name];
        input.value = v === null || v === undefined ? "" : String(v);
      }
    }
    view.apply.disabled = !editable;
  }

  function setStatus(text, error) {
    const s = document.getElementById("status");
    s.textContent = text;
    s.className = "status" + (error ? " error" : "");
  }

  function tokenNote() {
    const note = document.getElementById("token-note");
    if (!admin) note.textContent = "admin API off (start ferry serve with --admin-token): knobs are read-only";
    else if (token === "") note.textContent = "no token: knobs are read-only";
    else note.textContent = "kept in this page's memory only";
  }

  async function poll() {
    try {
      const response = await fetch("/ui/stats", { cache: "no-store", credentials: "omit" });
      if (!response.ok) throw new Error("HTTP " + response.status);
      const stats = await response.json();
      const t = Date.now() / 1000;
      admin = stats.admin;
      specs = stats.knob_specs;
      for (const model of stats.models) update(views.get(model.name) || createView(model), model, t);
      tokenNote();
      const state = stats.draining ? "draining" : stats.ready ? "ready" : "loading";
      setStatus(state + " · updated " + new Date().toLocaleTimeString() +
        (stats.window_s ? " · window " + fmt(stats.window_s, 1) + " s" : " · first snapshot"), false);
    } catch (e) {
      setStatus("no answer from /ui/stats (" + e.message + "); retrying", true);
    }
    setTimeout(poll, POLL_MS);
  }

  document.getElementById("token").addEventListener("input", (e) => {
    token = e.target.value;
    tokenNote();
    const editable = admin && token !== "";
    for (const view of views.values()) {
      for (const input of Object.values(view.inputs)) input.disabled = !editable;
      view.apply.disabled = !editable;
    }
  });
  document.getElementById("token-form").addEventListener("submit", (e) => e.preventDefault());
  poll();
})();
