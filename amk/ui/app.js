// amk ui: the front-end of amk/webui.py. Plain DOM code, no build step, nothing loaded from
// elsewhere. Each page is one <body data-page="..."> and one render function below.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "text") e.textContent = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else e.setAttribute(k, v);
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function param(name) { return new URLSearchParams(location.search).get(name); }
function q(obj) { return new URLSearchParams(obj).toString(); }
function fmt(x, d = 4) { return x === null || x === undefined ? "-" : (typeof x === "number" ? Number(x.toPrecision(d)).toString() : String(x)); }

async function api(path, body) {
  const opts = body === undefined ? {} : {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const r = await fetch(path, opts);
  let data;
  try { data = await r.json(); } catch (e) { data = {error: r.statusText}; }
  if (!r.ok) throw new Error(data.detail || data.error || r.statusText);
  return data;
}

function main() { return document.getElementById("main"); }
function setMain(...kids) { const m = main(); m.replaceChildren(...kids); }
function crumbs(...items) {
  const c = document.getElementById("crumbs");
  c.replaceChildren();
  for (const [text, href] of items) { c.append(" / "); c.append(href ? el("a", {href, text}) : el("span", {text})); }
}
function fail(err) { setMain(el("p", {class: "error", id: "error", text: "error: " + err.message})); }

function table(headers, rows, attrs) {
  const t = el("table", attrs || {});
  t.append(el("thead", {}, el("tr", {}, ...headers.map(h => el("th", {text: h})))));
  const tb = el("tbody");
  for (const r of rows) tb.append(r);
  t.append(tb);
  return t;
}

function td(v, cls) { return el("td", {class: cls || null}, v instanceof Node ? v : document.createTextNode(v === null || v === undefined ? "-" : String(v))); }

// ---------------------------------------------------------------- runs
async function pageIndex() {
  const data = await api("/api/runs");
  crumbs([data.root || "runs", null]);
  const rows = data.runs.map(r => {
    const page = {schedule: "schedule", trace: "trace"}[r.kind] || "run";
    const href = `/static/${page}.html?` + q({path: r.path});
    return el("tr", {class: "run-row"}, td(el("a", {href, text: r.path})), td(r.kind), td(r.model), td(r.tp), td(r.backend), td(r.proposer));
  });
  setMain(el("h1", {text: "runs and schedules"}),
    rows.length ? table(["path", "kind", "model", "tp", "backend", "proposer"], rows, {id: "runs"})
                : el("p", {class: "muted", text: "no search, tune or schedule directory here"}));
}

// ---------------------------------------------------------------- one run
function latencyChart(trials) {
  const pts = trials.filter(t => typeof t.latency_ms === "number");
  const W = 640, H = 220, L = 60, B = 30, T = 10, R = 10;
  const s = svg("svg", {width: W, height: H, class: "chart", id: "latency-chart", role: "img"});
  if (!pts.length) { const t = svg("text", {x: 20, y: 40}); t.textContent = "no latency yet"; s.append(t); return s; }
  const n = Math.max(...trials.map(t => t.trial)) || 1;
  const lo = Math.min(...pts.map(p => p.latency_ms)), hi = Math.max(...pts.map(p => p.latency_ms));
  const span = hi - lo || hi || 1;
  const x = i => L + (W - L - R) * (i / n);
  const y = v => T + (H - T - B) * (1 - (v - lo) / span);
  s.append(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#888"}));
  s.append(svg("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#888"}));
  for (const [v, yy] of [[hi, y(hi)], [lo, y(lo)]]) { const t = svg("text", {x: 4, y: yy + 4, "font-size": 11}); t.textContent = fmt(v, 3) + " ms"; s.append(t); }
  const xt = svg("text", {x: W / 2 - 20, y: H - 8, "font-size": 11}); xt.textContent = "trial"; s.append(xt);
  let best = Infinity, path = "";
  for (const p of pts.sort((a, b) => a.trial - b.trial)) {
    if (p.status === "KEEP" || p.latency_ms < best) best = Math.min(best, p.latency_ms);
    path += (path ? " L " : "M ") + x(p.trial) + " " + y(best);
  }
  s.append(svg("path", {d: path, fill: "none", stroke: "#0a7a2f", "stroke-width": 2}));
  for (const p of pts) {
    const c = svg("circle", {cx: x(p.trial), cy: y(p.latency_ms), r: 4, fill: p.status === "KEEP" ? "#0a7a2f" : "#8892a6", class: "point"});
    const tt = svg("title"); tt.textContent = `trial ${p.trial}: ${fmt(p.latency_ms)} ms (${p.timing_source}) ${p.status}`; c.append(tt);
    s.append(c);
  }
  return s;
}

async function pageRun() {
  const path = param("path");
  const data = await api("/api/run?" + q({path}));
  crumbs([path, null]);
  const trials = data.trials;
  const rows = trials.map(t => el("tr", {class: "trial-row", "data-trial": t.trial},
    td(t.trial, "num"), td(el("span", {class: "status-" + t.status, text: t.status})), td(t.proposer),
    td(fmt(t.ratio), "num"), td(fmt(t.latency_ms), "num"), td(t.timing_source),
    td(t.has_witness ? el("a", {href: "/static/verdict.html?" + q({path, trial: t.trial}), text: t.verdict, class: "witness-link"}) : t.verdict),
    td(t.reason)));
  const kids = [el("h1", {text: `${data.kind} ${path}`})];
  const s = data.summary || data.report || {};
  const st = (data.state && data.state.settings) || data.settings || {};
  kids.push(el("p", {class: "muted", text: `model ${st.model || s.model || "?"}, tp ${st.tp || s.tp || "?"}, backend ${st.backend || s.backend || "?"}` +
    (s.stop_reason ? `; stopped: ${s.stop_reason}` : "") + (st.approve ? "; proposals held for review (--approve)" : "")}));
  const links = el("p", {});
  links.append(el("a", {href: "/static/review.html?" + q({path}), id: "review-link", text: "review proposals"}));
  for (const sch of data.schedules || []) {
    links.append(" | ");
    links.append(el("a", {href: "/static/schedule.html?" + q({path: sch}), text: sch.split("/").slice(-2).join("/")}));
    links.append(" (");
    links.append(el("a", {href: "/static/edit.html?" + q({schedule: sch}), text: "edit"}));
    links.append(")");
  }
  kids.push(links);
  kids.push(el("h2", {text: "latency over trials (best so far: line)"}), latencyChart(trials));
  kids.push(el("h2", {text: `trials (${trials.length})`}));
  kids.push(table(["trial", "status", "proposer", "ratio", "latency ms", "timing", "verdict", "reason"], rows, {id: "trials"}));
  if (data.tunedb) {
    const tr = data.tunedb.map(e => e.error ? el("tr", {}, td(e.error)) :
      el("tr", {class: "tunedb-row"}, td(e.shape), td(e.gpu), td(e.tp, "num"), td(fmt(e.ms), "num"), td(fmt(e.ratio), "num"),
        td(fmt(e.roofline_pct, 3), "num"), td(e.date), td(e.source), td(e.file)));
    kids.push(el("h2", {text: "tuning database"}), table(["shape", "gpu", "tp", "ms", "ratio", "roofline %", "date", "source", "file"], tr, {id: "tunedb"}));
  }
  setMain(...kids);
}

// ---------------------------------------------------------------- one schedule
function traceView(trace) {
  const ev = trace.traceEvents;
  const tracks = new Map();
  const names = {};
  for (const e of ev) if (e.ph === "M" && e.name === "thread_name") names[e.pid + "." + e.tid] = `r${e.pid} ${e.args.name}`;
  const slices = ev.filter(e => e.ph === "X");
  for (const e of slices) { const k = e.pid + "." + e.tid; if (!tracks.has(k)) tracks.set(k, []); tracks.get(k).push(e); }
  const keys = [...tracks.keys()].sort((a, b) => { const [p1, t1] = a.split(".").map(Number), [p2, t2] = b.split(".").map(Number); return p1 - p2 || t1 - t2; });
  const end = Math.max(1e-9, ...slices.map(e => e.ts + e.dur));
  const L = 110, W = Math.max(900, Math.min(4000, slices.length * 6)), RH = 16;
  const H = keys.length * RH + 30;
  const s = svg("svg", {width: L + W + 10, height: H, id: "trace-view"});
  const x = t => L + W * (t / end);
  keys.forEach((k, i) => {
    const y = 20 + i * RH;
    const lab = svg("text", {x: 2, y: y + 11, "font-size": 11}); lab.textContent = names[k] || k; s.append(lab);
    for (const e of tracks.get(k)) {
      const wait = e.cat === "wait";
      const r = svg("rect", {x: x(e.ts), y: y + (wait ? 5 : 1), width: Math.max(0.5, x(e.ts + e.dur) - x(e.ts)), height: wait ? 4 : RH - 3,
        fill: wait ? "#c7ccd6" : colorOf(e.cat), class: wait ? "wait-slice" : "task-slice"});
      const tt = svg("title"); tt.textContent = wait ? `${e.name} (${fmt(e.dur)} us)` : `${e.name} ${e.cat} ${fmt(e.dur)} us, ${e.args.bytes} B, ${fmt(e.args.gbps)} GB/s`;
      r.append(tt); s.append(r);
    }
  });
  const ax = svg("text", {x: L, y: 12, "font-size": 11});
  ax.textContent = `0 .. ${fmt(end)} us (${trace.otherData.clock}; roofline ${fmt(trace.otherData.roofline.roofline_us)} us)`;
  s.append(ax);
  return s;
}

const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
function colorOf(name) { let h = 0; for (const c of String(name)) h = (h * 31 + c.charCodeAt(0)) >>> 0; return PALETTE[h % PALETTE.length]; }

async function pageSchedule() {
  const path = param("path");
  const data = await api("/api/schedule?" + q({path}));
  crumbs([path, null]);
  const s = data.summary, p = s.program;
  const crit = new Set(data.critical);
  const kids = [el("h1", {text: `schedule ${p.name}`}),
    el("p", {class: "muted", text: `${p.tasks} tasks, ${p.ranks} rank(s) x ${p.workers} worker(s), ${p.counters} counters; ${s.predicted.label}: cost model ${fmt(s.predicted.cost_model_us)} us, timeline ${fmt(s.predicted.timeline_makespan_us)} us`}),
    el("p", {}, el("a", {href: "/static/edit.html?" + q({schedule: path}), text: "edit this schedule"}))];
  kids.push(el("h2", {text: "queues (per rank and worker; critical path shaded)"}));
  const qrows = Object.entries(data.queues).map(([k, tasks]) => el("tr", {class: "queue-row"}, td(k), td(tasks.length, "num"),
    td(el("div", {class: "queue"}, ...tasks.map(t => el("span", {class: "pill" + (crit.has(t.id) ? " crit" : ""), title: `${t.op} ${fmt(t.start_us)}-${fmt(t.end_us)} us`, text: t.id}))))));
  kids.push(table(["rank.worker", "tasks", "queue (in order)"], qrows, {id: "queues"}));
  kids.push(el("h2", {text: "stages"}));
  kids.push(table(["stage", "rank", "tasks", "tasks per worker", "predicted us"], s.stages.map(r => el("tr", {class: "stage-row"},
    td(r.stage), td(r.rank, "num"), td(r.tasks, "num"), td(Object.entries(r.tasks_per_worker).map(([w, n]) => `${w}=${n}`).join(" ")), td(fmt(r.predicted_us), "num"))), {id: "stages"}));
  kids.push(el("h2", {text: "critical path (predicted)"}));
  kids.push(table(["task", "stage", "at", "start us", "end us"], s.critical_path.map(c => el("tr", {class: "crit-row"},
    td(c.task), td(c.stage), td(c.at), td(fmt(c.start_us), "num"), td(fmt(c.end_us), "num"))), {id: "critical"}));
  const traceUrl = "/api/trace?" + q({path});
  kids.push(el("h2", {text: "trace (simulated)"}),
    el("p", {}, el("a", {href: traceUrl, download: "trace.json", id: "trace-link", text: "trace.json"}),
      document.createTextNode(" (Chrome trace-event format: open it in ui.perfetto.dev or chrome://tracing)")),
    el("div", {class: "trace-wrap", id: "trace-wrap"}, el("p", {class: "muted", text: "drawing…"})));
  kids.push(el("h2", {text: "text IR"}), el("pre", {id: "ir"}, data.text));
  setMain(...kids);
  const trace = await api(traceUrl);
  document.getElementById("trace-wrap").replaceChildren(traceView(trace));
}

async function pageTrace() {
  const path = param("path");
  crumbs([path, null]);
  const trace = await api("/api/trace?" + q({path}));
  const o = trace.otherData || {};
  const rows = Object.entries(o).filter(([k, v]) => typeof v !== "object" || v === null).map(([k, v]) => el("tr", {}, td(k), td(fmt(v, 6))));
  const roof = o.roofline || {};
  setMain(el("h1", {text: "trace " + path}),
    el("p", {}, el("a", {href: "/api/trace?" + q({path}), download: path.split("/").pop(), id: "trace-link", text: "download"}),
      document.createTextNode(" (open it in ui.perfetto.dev or chrome://tracing)")),
    el("p", {class: "muted", text: `clock ${o.clock}: ${o.clock_note || ""}; roofline ${fmt(roof.roofline_us)} us, cost model ${fmt(roof.predicted_latency_us)} us`}),
    el("div", {class: "trace-wrap", id: "trace-wrap"}, traceView(trace)),
    el("h2", {text: "metadata (otherData)"}), table(["key", "value"], rows, {id: "trace-meta"}));
}

// ---------------------------------------------------------------- witness in the text IR
function escapeRe(s) { return s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"); }

function highlightedIR(text, hl) {
  const pre = el("pre", {id: "ir"});
  const names = [...(hl.tasks || []).map(n => [n, "task"]), ...(hl.counters || []).map(n => [n, "counter"])].sort((a, b) => b[0].length - a[0].length);
  const re = names.length ? new RegExp("(?<![\\w.\"-])(" + names.map(n => escapeRe(n[0])).join("|") + ")(?![\\w.\"-])", "g") : null;
  const kind = Object.fromEntries(names);
  let first = null;
  for (const line of text.split("\n")) {
    const span = el("span", {class: "line"});
    let last = 0, hit = false;
    if (re) for (const m of line.matchAll(re)) {
      span.append(line.slice(last, m.index));
      span.append(el("mark", {class: kind[m[1]] === "counter" ? "counter" : "task", text: m[1]}));
      last = m.index + m[1].length; hit = true;
    }
    span.append(line.slice(last));
    if (hit) { span.classList.add("hl"); first = first || span; }
    pre.append(span);
  }
  return [pre, first];
}

function verdictBlock(v) {
  const box = el("div", {id: "verdict", class: "card"});
  if (!v || v.ok === undefined) { box.append(el("p", {class: "muted", text: "no validator verdict for this trial"})); return box; }
  box.append(el("p", {class: v.ok ? "verdict-ok" : "verdict-bad", text: v.ok ? "accepted by the validator" : `rejected: ${(v.classes || []).join(", ")}`}));
  for (const e of v.errors || []) {
    const c = el("div", {class: "witness"});
    c.append(el("p", {}, el("b", {text: e.class + ": "}), document.createTextNode(e.message)));
    if (e.tasks && e.tasks.length) c.append(el("p", {}, document.createTextNode("tasks: "), ...e.tasks.map(t => el("span", {class: "pill", text: t}))));
    if (e.witness) c.append(el("pre", {class: "witness-json", text: JSON.stringify(e.witness, null, 1)}));
    box.append(c);
  }
  return box;
}

async function pageVerdict() {
  const path = param("path"), trial = param("trial");
  const data = await api("/api/verdict?" + q({path, trial}));
  crumbs([path, "/static/run.html?" + q({path})], ["trial " + trial, null]);
  const kids = [el("h1", {text: `trial ${trial}: ${data.status}`}), el("p", {text: data.reason || ""})];
  if (data.edits) kids.push(el("h2", {text: "edits"}), el("pre", {id: "edits", text: JSON.stringify(data.edits, null, 1)}));
  kids.push(el("h2", {text: "verdict and witness"}), verdictBlock(data.verdict));
  let first = null;
  if (data.text) {
    const [pre, f] = highlightedIR(data.text, data.highlight); first = f;
    kids.push(el("h2", {text: "the schedule it judged (text IR; the witness's tasks and counters marked)"}), pre);
  } else kids.push(el("p", {class: "muted", text: data.text_error || "the judged schedule is not kept for a knob trial: lower its config with amk compile to see it"}));
  setMain(...kids);
  if (first) first.scrollIntoView({block: "center"});
}

// ---------------------------------------------------------------- review
async function pageReview() {
  const path = param("path");
  crumbs([path, "/static/run.html?" + q({path})], ["review", null]);
  const draw = async () => {
    let data;
    try { data = await api("/api/review?" + q({path})); } catch (e) { fail(e); return; }
    const kids = [el("h1", {text: "proposals held for review"}),
      el("p", {class: "muted", text: "amk search --approve waits for a decision on each proposal; this page refreshes every second."})];
    const pend = el("div", {id: "pending"});
    if (!data.pending.length) pend.append(el("p", {class: "muted", id: "no-pending", text: "nothing pending"}));
    for (const p of data.pending) {
      const comment = el("input", {type: "text", placeholder: "comment (optional)", id: "comment-" + p.id, size: 50});
      const decide = async approve => {
        try { await api("/api/review/decide", {path, id: p.id, approve, comment: comment.value}); } catch (e) { alert(e.message); }
        draw();
      };
      const card = el("div", {class: "card pending", id: "pending-" + p.id},
        el("p", {}, el("b", {text: `${p.id}`}), document.createTextNode(` (${p.proposer}, candidate ${p.candidate_id})`)),
        el("p", {text: p.note || ""}),
        p.edits ? el("pre", {text: JSON.stringify(p.edits, null, 1)}) : el("pre", {text: JSON.stringify(p.config, null, 1)}),
        p.edits && p.base_schedule ? el("p", {}, el("a", {class: "preview", id: "preview-" + p.id, text: "check these edits in the editor (validator verdict) before deciding",
          href: "/static/edit.html?" + q({schedule: (path === "." ? "" : path + "/") + p.base_schedule, edits: JSON.stringify(p.edits)})})) : null,
        el("p", {}, comment),
        el("p", {}, el("button", {class: "approve", id: "approve-" + p.id, text: "approve", on: {click: () => decide(true)}}),
          el("button", {class: "reject", id: "reject-" + p.id, text: "reject", on: {click: () => decide(false)}})));
      pend.append(card);
    }
    kids.push(pend, el("h2", {text: "decided"}),
      table(["id", "decision", "candidate", "comment", "at"], data.decided.map(d => el("tr", {class: "decided-row"}, td(d.id), td(d.decision), td(d.candidate_id), td(d.comment), td(d.at))), {id: "decided"}));
    const focus = document.activeElement && document.activeElement.id;
    const typed = focus && document.getElementById(focus) ? document.getElementById(focus).value : null;
    setMain(...kids);
    if (focus && document.getElementById(focus)) { const f = document.getElementById(focus); if (typed !== null && "value" in f) f.value = typed; f.focus(); }
  };
  await draw();
  setInterval(() => { if (!document.activeElement || document.activeElement.tagName !== "INPUT") draw(); }, 1000);
}

// ---------------------------------------------------------------- editor
async function pageEdit() {
  const schedule = param("schedule");
  crumbs([schedule, "/static/schedule.html?" + q({path: schedule})], ["edit", null]);
  const edits = el("textarea", {id: "edits", rows: 8, spellcheck: "false"});
  edits.value = param("edits") || '[\n  {"op": "move", "task": "TASK_ID", "worker": 0}\n]';
  const name = el("input", {type: "text", id: "save-name", value: "edited", size: 20});
  const out = el("div", {id: "result"});
  const go = async save => {
    out.replaceChildren(el("p", {class: "muted", text: "validating…"}));
    let data;
    try { data = await api("/api/edit/validate", {schedule, edits: edits.value, save: save ? name.value : null}); }
    catch (e) { out.replaceChildren(el("p", {class: "error", id: "edit-error", text: "error: " + e.message})); return; }
    const kids = [verdictBlock(data.verdict)];
    if (data.saved) kids.push(el("p", {id: "saved", text: "saved as " + data.saved}));
    else if (save) kids.push(el("p", {class: "error", id: "not-saved", text: "not saved: the validator rejected the edited schedule"}));
    const [pre, first] = highlightedIR(data.text, data.highlight);
    kids.push(el("h2", {text: "the edited schedule (text IR; the witness's tasks and counters marked)"}), pre);
    out.replaceChildren(...kids);
    if (first) first.scrollIntoView({block: "center"});
  };
  const irBox = el("textarea", {id: "ir-text", rows: 18, spellcheck: "false"});
  const irName = el("input", {type: "text", id: "ir-save-name", value: "edited-ir", size: 20});
  const goText = async save => {
    out.replaceChildren(el("p", {class: "muted", text: "validating…"}));
    let data;
    try { data = await api("/api/edit/validate", {schedule, text: irBox.value, save: save ? irName.value : null}); }
    catch (e) { out.replaceChildren(el("p", {class: "error", id: "edit-error", text: "error: " + e.message})); return; }
    const kids = [verdictBlock(data.verdict)];
    if (data.saved) kids.push(el("p", {id: "saved", text: "saved as " + data.saved}));
    else if (save) kids.push(el("p", {class: "error", id: "not-saved", text: "not saved: the validator rejected the schedule"}));
    const [pre, first] = highlightedIR(data.text, data.highlight);
    kids.push(el("h2", {text: "the schedule (text IR; the witness's tasks and counters marked)"}), pre);
    out.replaceChildren(...kids);
    if (first) first.scrollIntoView({block: "center"});
  };
  const irPart = el("details", {id: "ir-editor"}, el("summary", {text: "or edit the text IR itself"}), irBox,
    el("p", {}, el("button", {id: "ir-validate", text: "validate", on: {click: () => goText(false)}}),
      el("button", {id: "ir-save", text: "save as", on: {click: () => goText(true)}}), irName));
  api("/api/schedule?" + q({path: schedule})).then(d => { irBox.value = d.text; }).catch(() => {});
  setMain(el("h1", {text: "edit " + schedule}),
    el("p", {class: "muted", text: "A JSON list of typed edits (move, swap, split, merge, replace, refine_wait, add_wait, drop_wait, add_signal, drop_signal, add_counter; docs/ir.md). Save validates and writes edited/NAME.amk beside the schedule only when the validator accepts it."}),
    edits, el("p", {}, el("button", {id: "validate", text: "validate", on: {click: () => go(false)}}),
      el("button", {id: "save", text: "save as", on: {click: () => go(true)}}), name), irPart, out);
}

const PAGES = {index: pageIndex, run: pageRun, schedule: pageSchedule, trace: pageTrace, verdict: pageVerdict, review: pageReview, edit: pageEdit};
document.addEventListener("DOMContentLoaded", () => {
  const fn = PAGES[document.body.dataset.page];
  if (fn) fn().then(() => document.body.setAttribute("data-ready", "1")).catch(err => { fail(err); document.body.setAttribute("data-ready", "1"); });
});
