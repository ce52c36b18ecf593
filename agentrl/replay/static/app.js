// agentrl replay: a dependency-free single-page inspector over /api/*.
//
// Security rule for this file: model output is untrusted. Every string from
// the server reaches the page through text nodes (the `h` helper and
// `textContent`); nothing here assigns HTML (no innerHTML, no insertAdjacentHTML).
"use strict";

const state = {
  run: null,          // /api/run
  listCursors: [],    // stack of cursors for "previous page"
  tokenField: "loss_mask",
  timer: null,
  playTimer: null,
};

// ------------------------------------------------------------------ helpers

function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = String(v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style") el.style.cssText = v;  // CSSOM, allowed by the CSP (style attributes are not)
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function svg(tag, attrs, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children) el.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

async function api(path, options) {
  const resp = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) throw new Error((body && body.error) || `${resp.status} ${resp.statusText}`);
  return body;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "n/a";
  if (typeof x === "number") {
    if (Number.isInteger(x)) return String(x);
    return x.toFixed(digits === undefined ? 3 : digits);
  }
  return String(x);
}

// an axis label: 3 significant digits, exponent notation for tiny or huge values (KL can be 1e-12)
function fmtAxis(y) {
  if (y === 0) return "0";
  const a = Math.abs(y);
  if (a < 1e-3 || a >= 1e5) return y.toExponential(1);
  return String(Number(y.toPrecision(3)));
}

function setMain(...children) {
  const app = document.getElementById("app");
  app.replaceChildren(...children);
}

function showError(err) {
  setMain(h("div", { class: "error-box", id: "error" }, String(err && err.message ? err.message : err)));
}

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/overview";
  const [path, query] = raw.split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), params: new URLSearchParams(query || "") };
}

function navActive(name) {
  for (const id of ["nav-overview", "nav-list"]) {
    document.getElementById(id).classList.toggle("active", id === `nav-${name}`);
  }
}

// ------------------------------------------------------------------ router

async function route() {
  stopPlayback();
  hideTooltip();
  const { parts, params } = parseHash();
  try {
    if (parts[0] === "t" && parts[1]) { navActive("list"); await showTrajectory(parts[1], params); }
    else if (parts[0] === "g" && parts[1]) { navActive("list"); await showGroupPage(parts[1]); }
    else if (parts[0] === "list") { navActive("list"); await showList(params); }
    else { navActive("overview"); await showOverview(); }
  } catch (err) {
    showError(err);
  }
}

async function refreshRun() {
  try {
    state.run = await api("/api/run");
    const cfg = state.run.config || {};
    const name = (cfg.run && cfg.run.name) || state.run.path;
    document.getElementById("run-name").textContent = name;
    document.getElementById("live-count").textContent = `${state.run.count} trajectories`;
    document.getElementById("live").classList.remove("stale");
  } catch (err) {
    document.getElementById("live").classList.add("stale");
  }
}

// ------------------------------------------------------------------ overview

async function showOverview() {
  const data = await api("/api/metrics");
  const run = state.run || {};
  const steps = data.steps || [];
  const layout = data.layout || { headline: [], groups: [], constants: [] };
  const stats = h("div", { class: "stats" },
    h("div", {}, h("b", { text: fmt(run.count) }), "trajectories"),
    h("div", {}, h("b", { text: steps.length ? fmt(steps[steps.length - 1].step) : "n/a" }), "latest step"),
    h("div", {}, h("b", { text: fmt(data.metrics.length) }), "steps with metrics"));
  // the curves a user opens the page for, in a fixed order; then the rest by prefix; constants on one line
  const charts = h("div", { class: "charts", id: "charts" }, layout.headline.map(c => chart(c)));
  const groups = layout.groups.map(g => h("section", { class: "metric-group", dataset: { prefix: g.prefix } },
    h("h3", { class: "group-title", text: `${g.prefix}/` }),
    h("div", { class: "charts" }, g.charts.map(c => chart(c)))));
  const constants = layout.constants.length
    ? h("div", { class: "panel constants", id: "constants" }, h("b", { text: "constant: " }),
      layout.constants.map(([k, v]) => h("span", { class: "const", dataset: { key: k } }, h("code", { text: k }), `=${fmt(v, 4)}`)))
    : null;
  const cfg = run.config ? h("details", { class: "panel" }, h("summary", { text: "run config" }),
    h("pre", { class: "code", text: JSON.stringify(run.config, null, 2) })) : null;
  setMain(h("h2", { text: "Run overview" }), h("div", { class: "panel" }, stats),
    charts.childElementCount ? charts : h("p", { class: "muted", text: "No steps recorded yet." }),
    ...groups, constants, cfg);
}

// One chart: { id, title, series: [{label, key, points: [[step, value], ...]}], band?: [[step, lo, hi]] },
// every series on the same axes, one colour each (classes s0, s1, ...), with a legend. A series with a
// `colour` (per-policy charts: the policy's place in the run) uses it, so a policy looks the same everywhere.
function chart(spec) {
  const W = 340, H = 150, L = 52, R = 8, T = 8, B = 20;
  const box = h("div", { class: "panel chart", dataset: { metric: spec.id } }, h("h3", { text: spec.title }));
  const finite = p => p[1] !== null && p[1] !== undefined && isFinite(p[1]);
  const series = spec.series.map((s, i) => Object.assign({}, s, { pts: s.points.filter(finite),
    cls: `s${(s.colour === undefined || s.colour === null ? i : s.colour) % 9}` }));
  const all = series.flatMap(s => s.pts);
  if (series.length > 1) {
    box.appendChild(h("div", { class: "series-legend" }, series.map((s, i) =>
      h("span", { class: `series ${s.cls}`, dataset: s.policy ? { key: s.key, policy: s.policy } : { key: s.key }, title: s.key }, h("span", { class: "swatch" }), s.label))));
  }
  if (!all.length) { box.appendChild(h("p", { class: "muted", text: "no finite values" })); return box; }
  const band = spec.band || [];
  let ys = all.map(p => p[1]);
  for (const b of band) { if (b[1] !== null) ys.push(b[1]); if (b[2] !== null) ys.push(b[2]); }
  const xs = all.map(p => p[0]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 + 1e-9; y1 += Math.abs(y1) * 0.1 + 1e-9; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    g.appendChild(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(y), y2: sy(y) }));
    g.appendChild(svg("text", { x: 2, y: sy(y) + 3 }, fmtAxis(y)));
  }
  g.appendChild(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  g.appendChild(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  g.appendChild(svg("text", { x: L, y: H - 5 }, `step ${fmt(x0)}`));
  g.appendChild(svg("text", { x: W - R - 60, y: H - 5 }, `step ${fmt(x1)}`));
  const ok = band.filter(b => b[1] !== null && b[2] !== null);
  if (ok.length > 1) {
    const d = ok.map((b, i) => `${i ? "L" : "M"}${sx(b[0])},${sy(b[2])}`).join(" ") + " " +
      ok.slice().reverse().map(b => `L${sx(b[0])},${sy(b[1])}`).join(" ") + " Z";
    g.appendChild(svg("path", { class: "band", d }));
  }
  series.forEach(s => {
    if (!s.pts.length) return;
    g.appendChild(svg("path", { class: `line ${s.cls}`, "data-key": s.key,
      d: s.pts.map((p, k) => `${k ? "L" : "M"}${sx(p[0])},${sy(p[1])}`).join(" ") }));
    if (s.pts.length <= 60) {
      for (const p of s.pts) {
        g.appendChild(svg("circle", { class: s.cls, cx: sx(p[0]), cy: sy(p[1]), r: 2.2 },
          svg("title", {}, `${s.label} · step ${p[0]}: ${fmt(p[1], 4)}`)));
      }
    }
  });
  box.appendChild(g);
  return box;
}

// ------------------------------------------------------------------ list

const FILTER_FIELDS = ["step_min", "step_max", "env", "status", "reward_min", "reward_max", "error", "truncated",
  "tool", "policy", "length_min", "length_max", "search", "order"];

function select(name, values, current, labels) {
  return h("select", { name }, values.map((v, i) => h("option", { value: v, selected: v === current },
    labels ? labels[i] : (v === "" ? "any" : v))));
}

async function showList(params) {
  const run = state.run || { filters: {} };
  const f = run.filters || {};
  const val = k => params.get(k) || "";
  const policies = f.policy || [];  // a multi-policy run's policies (none: the list looks as it always did)
  const input = (name, type, placeholder) => h("label", {}, name.replace("_", " "),
    h("input", { name, type: type || "text", value: val(name), placeholder: placeholder || "", step: "any" }));
  const form = h("form", { id: "filters", onsubmit: ev => { ev.preventDefault(); applyFilters(form); } },
    input("search", "search", "full text (word, prefix*)"),
    input("step_min", "number"), input("step_max", "number"),
    h("label", {}, "env", select("env", ["", ...(f.env || [])], val("env"))),
    h("label", {}, "status", select("status", ["", ...(f.status || [])], val("status"))),
    input("reward_min", "number"), input("reward_max", "number"),
    h("label", {}, "error", select("error", ["", "none", "any", ...(f.error_class || [])], val("error"))),
    h("label", {}, "truncated", select("truncated", ["", "true", "false"], val("truncated"))),
    h("label", {}, "tool used", select("tool", ["", ...(f.tool || [])], val("tool"))),
    policies.length ? h("label", {}, "policy", select("policy", ["", ...policies], val("policy"))) : null,
    input("length_min", "number"), input("length_max", "number"),
    h("label", {}, "order", select("order", ["newest", "oldest", "reward_desc", "reward_asc", "length_desc", "length_asc"],
      val("order") || "newest")),
    h("button", { class: "primary", type: "submit", id: "apply" }, "Apply"),
    h("button", { type: "button", onclick: () => { location.hash = "#/list"; } }, "Reset"));
  const query = new URLSearchParams();
  for (const k of FILTER_FIELDS) if (params.get(k)) query.set(k, params.get(k));
  const cursor = params.get("cursor");
  const listQuery = new URLSearchParams(query);
  listQuery.set("limit", "50");
  if (cursor) listQuery.set("cursor", cursor);
  const [page, count] = await Promise.all([api(`/api/trajectories?${listQuery}`), api(`/api/count?${query}`)]);
  const rows = page.items.map(r => h("tr", { class: "row", dataset: { id: r.id }, onclick: () => { location.hash = `#/t/${encodeURIComponent(r.id)}`; } },
    h("td", { class: "num", text: r.seq }), h("td", { class: "num", text: fmt(r.step) }), h("td", { text: r.env }),
    h("td", { text: r.status }),
    policies.length ? h("td", { class: "policies" }, (r.policies || []).map(p => h("span", { class: "badge policy-badge", text: p }))) : null,
    h("td", { class: "num reward", text: fmt(r.reward) }),
    h("td", { class: "num", text: r.num_tokens }), h("td", { class: "num turns", text: r.num_turns }),
    h("td", { class: "num calls", text: r.num_tool_calls }),
    h("td", { text: (r.tools || []).join(", ") }),
    h("td", {}, r.error_class ? h("span", { class: "badge bad", text: r.error_class }) : null,
      r.truncated ? h("span", { class: "badge warn", text: "truncated" }) : null),
    h("td", { class: "preview", text: r.preview, title: r.preview })));
  const table = h("table", { id: "traj-table" },
    h("thead", {}, h("tr", {}, ["#", "step", "env", "status", ...(policies.length ? ["policy"] : []), "reward", "tokens", "turns", "calls", "tools", "flags", "task ⟶ final answer"].map(t => h("th", { text: t })))),
    h("tbody", {}, rows));
  const pageParams = next => { const p = new URLSearchParams(query); if (next) p.set("cursor", next); return `#/list?${p}`; };
  const back = params.get("back");
  const pager = h("div", { class: "pager" },
    h("span", { id: "match-count", text: `${count.count} matching` }),
    cursor ? h("a", { href: back ? pageParams(back) : pageParams(null), id: "prev" }, "← first/previous") : null,
    page.next_cursor ? h("a", { href: (() => { const p = new URLSearchParams(query); p.set("cursor", page.next_cursor); if (cursor) p.set("back", cursor); return `#/list?${p}`; })(), id: "next" }, "next →") : null);
  setMain(h("h2", { text: "Trajectories" }), h("div", { class: "panel" }, form),
    h("div", { class: "panel" }, page.items.length ? table : h("p", { class: "muted", id: "empty", text: "No trajectory matches." }), pager));
}

function applyFilters(form) {
  const p = new URLSearchParams();
  for (const el of form.elements) {
    if (el.name && el.value && !(el.name === "order" && el.value === "newest")) p.set(el.name, el.value);
  }
  location.hash = `#/list?${p}`;
}

// ------------------------------------------------------------------ trajectory

async function showTrajectory(id, params) {
  const data = await api(`/api/trajectories/${encodeURIComponent(id)}`);
  const t = data.trajectory;
  const tab = params.get("tab") || "conversation";
  const err = t.error;
  const meta = h("div", { class: "meta-grid" },
    kv("id", t.id), kv("task", t.task_id), kv("env", t.env), kv("step", fmt(data.step)), kv("status", data.status),
    kv("reward", fmt(t.reward)), kv("terminated", String(t.terminated)), kv("truncated", t.truncated ? `true (${t.truncation_reason || "?"})` : "false"),
    kv("sample", `${t.sample_index}`), kv("seed", fmt(t.seed)), kv("tokens", `${data.tokens.ids.length} (${data.tokens.loss_mask.filter(x => x).length} sampled)`),
    h("div", {}, h("span", { text: "group" }), t.group_id ? h("a", { href: `#/g/${encodeURIComponent(t.group_id)}`, id: "group-link", text: t.group_id }) : "n/a"),
    branchOf(t.info && t.info.branch), ...seatOf(t));
  const breakdown = Object.keys(t.reward_breakdown || {}).length
    ? h("table", { id: "reward-breakdown" }, h("tbody", {}, Object.entries(t.reward_breakdown).map(([k, v]) => h("tr", {}, h("td", { text: k }), h("td", { class: "num", text: fmt(v) })))))
    : null;
  const header = h("div", { class: "panel" }, h("h2", { text: `Trajectory ${t.id}` }), meta,
    err ? h("div", { class: "error-box", id: "episode-error" }, `error (${err.kind}, turn ${fmt(err.turn)}): `, err.message) : null,
    breakdown ? h("h3", { text: "reward breakdown" }) : null, breakdown,
    h("div", { class: "playback" }, h("button", { id: "check", onclick: () => runCheck(t.id) }, "Re-execute against env"),
      h("span", { class: "muted", text: "replays the stored assistant messages on a fresh env and compares" })),
    h("div", { id: "check-result" }));
  const tabs = h("div", { class: "tabs" }, ["conversation", "tokens", "group"].map(name =>
    h("button", { class: name === tab ? "active" : "", id: `tab-${name}`, onclick: () => { location.hash = `#/t/${encodeURIComponent(t.id)}?tab=${name}`; } }, name)));
  let body;
  if (tab === "tokens") body = tokenView(data);
  else if (tab === "group") body = h("div", { id: "group-view" }, h("p", { class: "muted", text: "loading group…" }));
  else body = conversationView(t, data.layout);
  setMain(header, tabs, body);
  if (tab === "group") await fillGroup(document.getElementById("group-view"), t.group_id, t.id);
}

// A gateway branch (the agent rewrote its history): a link to the trajectory it branched from, and why.
function branchOf(branch) {
  if (!branch || typeof branch !== "object") return null;
  const parent = branch.parent ? h("a", { href: `#/t/${encodeURIComponent(branch.parent)}`, id: "branch-parent", text: branch.parent }) : "n/a";
  return h("div", { id: "branch-of" }, h("span", { text: "branch of" }), parent, branch.reason ? ` (${branch.reason})` : "");
}

// A multi-agent trajectory's seat: its agent id, the policy that played it, the game's outcome for it;
// a trajectory whose turns several policies sampled lists them (each turn is labelled too).
function seatOf(t) {
  const info = t.info || {};
  const policies = [...new Set((t.turns || []).map(x => x.policy).filter(p => typeof p === "string"))];
  if (typeof info.policy === "string" && !policies.includes(info.policy)) policies.push(info.policy);
  const out = [];
  if (typeof info.agent === "string") out.push(h("div", { id: "traj-agent" }, h("span", { text: "agent" }), info.agent));
  if (policies.length) {
    out.push(h("div", { id: "traj-policies" }, h("span", { text: policies.length > 1 ? "policies" : "policy" }),
      policies.map(p => h("span", { class: "badge policy-badge", text: p }))));
  }
  if (typeof info.outcome === "string") {
    const cls = info.outcome === "win" ? "good" : info.outcome === "loss" ? "bad" : "";
    out.push(h("div", { id: "traj-outcome" }, h("span", { text: "outcome" }), h("span", { class: `badge ${cls}`, text: info.outcome })));
  }
  return out;
}

function kv(k, v) { return h("div", {}, h("span", { text: k }), v === null || v === undefined ? "n/a" : String(v)); }

// conversation ------------------------------------------------------

// Which policy spoke a turn (a multi-policy run: Turn.policy), with the agent it played when there is one.
function turnPolicy(turn, info) {
  if (!turn || typeof turn.policy !== "string") return null;
  const agent = info && typeof info.agent === "string" ? info.agent : null;
  return h("span", { class: "badge policy-badge turn-policy", dataset: { policy: turn.policy }, title: "the policy that sampled this turn",
    text: agent ? `${turn.policy} · ${agent}` : turn.policy });
}

// A turn sampled under a grammar (the gateway's tool_choice / response_format): its logprobs are the masked
// distribution's, so the trainer's importance weights carry the mask.
function turnConstraint(turn) {
  const label = turn && turn.info && typeof turn.info.constrained === "string" ? turn.info.constrained : null;
  if (!label) return null;
  return h("span", { class: "badge constrained-badge", title: "sampled from the grammar-masked distribution (constrained decoding); its logprobs are that distribution's",
    text: `constrained · ${label}` });
}

// The prompt (system prompt, few-shot demonstrations, the task) is shown as the prompt: demonstrations
// grouped in one collapsed block, nothing in it numbered as a turn. Turn numbers and playback count the
// episode's own model turns (t.turns), from 0, like the token view and the error's turn.
function conversationView(t, layout) {
  const L = layout || { system_end: 0, task_start: 0, prompt_end: 0 };
  const turns = t.turns || [];
  const wrap = h("div", { id: "conversation" });
  let turn = -1;
  let pending = null;  // a turn's sandbox output, shown after that turn's tool messages
  let demos = null;
  const flush = () => { if (pending) { wrap.appendChild(pending); pending = null; } };
  t.messages.forEach((m, i) => {
    const inPrompt = i < L.prompt_end;
    const part = !inPrompt ? null : i < L.system_end ? "system prompt" : i < L.task_start ? "demonstration" : "task";
    if (!inPrompt && m.role === "assistant") { flush(); turn += 1; }  // prompt messages are never turns
    const card = h("div", { class: `msg ${m.role}${part ? " prompt" : ""}`, dataset: { turn: String(inPrompt ? -1 : turn), role: m.role, part: part || "episode" } },
      h("div", { class: "role" }, m.role, m.name ? ` · ${m.name}` : "", m.tool_call_id ? ` · answers ${m.tool_call_id}` : "",
        part ? h("span", { class: "badge prompt-badge", text: `prompt · ${part}` }) : null,
        !inPrompt && m.role === "assistant"
          ? h("span", { class: "badge turn-badge", text: turns[turn] ? `turn ${turn} · reward ${fmt(turns[turn].reward)}` : `turn ${turn}` }) : null,
        !inPrompt && m.role === "assistant" ? turnPolicy(turns[turn], t.info) : null,
        !inPrompt && m.role === "assistant" ? turnConstraint(turns[turn]) : null),
      h("pre", { class: "content", text: m.content }));
    for (const c of m.tool_calls || []) {
      card.appendChild(h("div", { class: "toolcall" }, h("span", { class: "name", text: c.name }), " ",
        h("span", { class: "muted", text: c.id }),
        h("pre", { class: "code", text: JSON.stringify(c.arguments, null, 2) }),
        c.error ? h("div", { class: "error-box", text: `parse error: ${c.error}` }) : null));
    }
    if (part === "demonstration") {
      if (!demos) {
        const n = L.task_start - L.system_end;
        const examples = t.messages.slice(L.system_end, L.task_start).filter(x => x.role === "user").length;
        demos = h("details", { class: "demos", id: "demonstrations", dataset: { turn: "-1" } },
          h("summary", { text: t.info && t.info.branch
            ? `history this branch was given (${n} messages, as the agent resent it): in the prompt, not sampled on this branch`
            : `few-shot demonstrations: ${examples} worked example${examples === 1 ? "" : "s"} (${n} messages) in the prompt, not sampled in this episode` }));
        wrap.appendChild(demos);
      }
      demos.appendChild(card);
      return;
    }
    wrap.appendChild(card);
    if (!inPrompt && m.role === "assistant" && turns[turn]) {
      const info = turns[turn].info || {};
      const sandbox = findSandbox(info);
      if (sandbox) {
        pending = h("div", { class: "msg tool sandbox", dataset: { turn: String(turn), role: "sandbox" } },
          h("div", { class: "role", text: `sandbox · exit ${fmt(sandbox.exit_code)}` }));
        if (sandbox.stdout) pending.appendChild(h("div", {}, h("span", { class: "muted", text: "stdout" }), h("pre", { class: "code", text: sandbox.stdout })));
        if (sandbox.stderr) pending.appendChild(h("div", {}, h("span", { class: "muted", text: "stderr" }), h("pre", { class: "code stderr", text: sandbox.stderr })));
      }
      if (Object.keys(info).length) {
        card.appendChild(h("details", {}, h("summary", { class: "muted", text: "turn info" }), h("pre", { class: "code", text: JSON.stringify(info, null, 2) })));
      }
    }
  });
  flush();
  const nTurns = Math.max(turn + 1, 0);
  const verdict = testsVerdict(t, nTurns);
  if (verdict) wrap.appendChild(verdict);
  const label = h("span", { id: "play-label" });
  const controls = h("div", { class: "playback panel" },
    h("b", { text: "Playback" }),
    h("button", { id: "play-first", onclick: () => setPlay(wrap, label, 0, nTurns) }, "|◀ start"),
    h("button", { id: "play-prev", onclick: () => setPlay(wrap, label, Number(wrap.dataset.play) - 1, nTurns) }, "◀ prev turn"),
    h("button", { id: "play-next", onclick: () => setPlay(wrap, label, Number(wrap.dataset.play) + 1, nTurns) }, "next turn ▶"),
    h("button", { id: "play-auto", onclick: () => autoPlay(wrap, label, nTurns) }, "▶ play"),
    h("button", { id: "play-all", onclick: () => setPlay(wrap, label, nTurns, nTurns) }, "show all"),
    label);
  const info = Object.keys(t.info || {}).filter(k => k !== "token_stats").length
    ? h("details", { class: "panel" }, h("summary", { text: "trajectory info" }),
      h("pre", { class: "code", text: JSON.stringify(Object.fromEntries(Object.entries(t.info).filter(([k]) => k !== "token_stats")), null, 2) }))
    : null;
  const out = h("div", {}, controls, wrap, info,
    h("details", { class: "panel" }, h("summary", { text: "task" }), h("pre", { class: "code", text: JSON.stringify(t.task, null, 2) })));
  setPlay(wrap, label, nTurns, nTurns);
  return out;
}

// The verdict of the task's own tests (terminal and harbor envs put it in the reward breakdown: tests,
// tests_exit_code, tests_timed_out), after the last turn: it is what the episode ended with.
function testsVerdict(t, nTurns) {
  const b = t.reward_breakdown || {};
  if (!("tests_exit_code" in b)) return null;
  const timedOut = Number(b.tests_timed_out) > 0;
  const code = Number(b.tests_exit_code);
  const reward = Number(b.tests);  // what the tests wrote (Harbor: the reward file), whatever their exit code
  const word = timedOut || !(reward > 0) ? "failed" : reward >= 1 ? "passed" : "partly passed";
  const how = timedOut ? "timed out" : code < 0 ? "no exit code" : `exit code ${code}`;
  return h("div", { class: `msg verdict ${word === "passed" ? "pass" : "fail"}`, id: "tests-verdict", dataset: { turn: String(Math.max(nTurns - 1, 0)), role: "verdict" } },
    h("div", { class: "role", text: "tests · verdict" }),
    h("pre", { class: "content", text: `${word}: reward ${fmt(b.tests)} (${how})` }));
}

function findSandbox(info) {
  if (info.sandbox && typeof info.sandbox === "object") return info.sandbox;
  if ("stdout" in info || "stderr" in info) return info;
  return null;
}

function setPlay(wrap, label, k, n) {
  k = Math.max(0, Math.min(k, n));
  wrap.dataset.play = String(k);
  // show the opening, then turns 0..k-1 with what followed them; `n` shows everything
  for (const el of wrap.children) {
    const turn = Number(el.dataset.turn);
    el.classList.toggle("future", k < n && turn >= k);
    el.classList.toggle("current", k < n && turn === k - 1);
  }
  label.textContent = k >= n ? `all ${n} turn${n === 1 ? "" : "s"}` : `turn ${k} of ${n}`;
}

function autoPlay(wrap, label, n) {
  stopPlayback();
  setPlay(wrap, label, 0, n);
  state.playTimer = setInterval(() => {
    const k = Number(wrap.dataset.play) + 1;
    setPlay(wrap, label, k, n);
    if (k >= n) stopPlayback();
  }, 900);
}

function stopPlayback() {
  if (state.playTimer) { clearInterval(state.playTimer); state.playTimer = null; }
}

// re-execution ------------------------------------------------------

async function runCheck(id) {
  const out = document.getElementById("check-result");
  const btn = document.getElementById("check");
  btn.disabled = true;
  out.replaceChildren(h("p", { class: "muted", text: "re-executing…" }));
  try {
    const r = await api(`/api/trajectories/${encodeURIComponent(id)}/check`, { method: "POST", headers: { "X-Agentrl-Request": "check" } });
    const rows = (r.steps || []).map(s => h("details", { open: !s.ok },
      h("summary", { class: s.ok ? "ok" : "fail", text: `${s.turn === null ? "reset" : `turn ${s.turn}`}: ${s.ok ? "reproduced" : "differs"}${s.note ? ` (${s.note})` : ""}${s.reward_replayed !== null && s.reward_replayed !== undefined ? ` · reward stored ${fmt(s.reward_stored)} / replayed ${fmt(s.reward_replayed)}` : ""}` }),
      h("div", { class: "diff" },
        h("div", {}, h("b", { text: "stored" }), h("pre", { class: "code", text: JSON.stringify(s.stored, null, 2) })),
        h("div", {}, h("b", { text: "replayed" }), h("pre", { class: "code", text: JSON.stringify(s.replayed, null, 2) })))));
    out.replaceChildren(h("div", { class: "panel check-report", id: "check-report" },
      h("div", { class: r.ok ? "ok" : "fail", id: "check-verdict", text: r.ok ? "✔ reproduces: observations and reward match" : "✘ does not reproduce" }),
      r.error ? h("div", { class: "error-box", text: r.error }) : null,
      h("div", { text: `observations: ${r.observations_ok ? "match" : "differ"} · reward stored ${fmt(r.reward_stored)} / replayed ${fmt(r.reward_replayed)}` }),
      rows));
  } catch (err) {
    out.replaceChildren(h("div", { class: "error-box", text: String(err.message || err) }));
  } finally {
    btn.disabled = false;
  }
}

// tokens ------------------------------------------------------------

const TOKEN_FIELDS = {
  loss_mask: { label: "loss mask", key: "loss_mask" },
  logprobs: { label: "behaviour logprob", key: "logprobs", masked: true },
  trainer_logprobs: { label: "trainer logprob", key: "trainer_logprobs", masked: true },
  is_weights: { label: "importance weight", key: "is_weights", masked: true },
  is_mask: { label: "importance mask", key: "is_mask", masked: true },
  advantages: { label: "advantage", key: "advantages", masked: true },
  versions: { label: "policy version", key: "versions", masked: true },
};

function colourFor(field, v, tok) {
  if (v === null || v === undefined) return null;
  switch (field) {
    case "loss_mask": return v ? "#cfe3ff" : "#f0f0f0";
    case "logprobs": case "trainer_logprobs": {
      const p = Math.exp(Math.max(v, -20));           // probability: red (low) → green (high)
      return `hsl(${Math.round(p * 120)}, 70%, 80%)`;
    }
    case "is_weights": {
      const x = Math.max(-1, Math.min(1, Math.log2(Math.max(v, 1e-6))));  // 0.5..2 → blue..white..red
      return x >= 0 ? `hsl(0, 75%, ${100 - 30 * x}%)` : `hsl(220, 75%, ${100 + 30 * x}%)`;
    }
    case "is_mask": return v ? "#c9f0d6" : "#f6c4c4";
    case "advantages": {
      const m = tok.maxAbsAdv || 1, x = Math.max(-1, Math.min(1, v / m));
      return x >= 0 ? `hsl(140, 60%, ${100 - 32 * x}%)` : `hsl(0, 70%, ${100 + 32 * x}%)`;
    }
    case "versions": return v < 0 ? null : `hsl(${(v * 67) % 360}, 65%, 82%)`;
  }
  return null;
}

function tokenView(data) {
  const tok = data.tokens;
  const n = tok.ids.length;
  const advs = (tok.advantages || []).filter(x => x !== null).map(Math.abs);
  tok.maxAbsAdv = advs.length ? Math.max(...advs) : 1;
  const sel = h("select", { id: "colour-by", onchange: () => { state.tokenField = sel.value; paint(); } },
    Object.entries(TOKEN_FIELDS).map(([k, f]) => h("option", { value: k, selected: k === state.tokenField },
      f.label + (tok[f.key] ? "" : " (n/a)"))));
  const legend = h("div", { class: "legend", id: "legend" });
  const notice = h("div", { id: "token-notice", class: "muted" });
  const box = h("div", { id: "tokens" });
  const frag = document.createDocumentFragment();
  for (let i = 0; i < n; i++) {
    let text = tok.text ? tok.text[i] : `⟨${tok.ids[i]}⟩`;
    const span = h("span", { class: "tok", dataset: { i: String(i) } });
    if (text.includes("\n")) {
      span.append(text.replace(/\n/g, "↵"));
      frag.appendChild(span);
      frag.appendChild(document.createTextNode("\n"));
      continue;
    }
    span.textContent = text === "" ? "∅" : text;
    frag.appendChild(span);
  }
  box.appendChild(frag);
  box.addEventListener("mousemove", ev => {
    const span = ev.target.closest ? ev.target.closest("span.tok") : null;
    if (!span) { hideTooltip(); return; }
    showTooltip(ev, tokenDetails(tok, Number(span.dataset.i), data.trajectory.turns || []));
  });
  box.addEventListener("mouseleave", hideTooltip);
  function paint() {
    const f = TOKEN_FIELDS[state.tokenField];
    const values = tok[f.key];
    notice.textContent = values ? "" : `${f.label}: n/a for this trajectory (the trainer has not stored it; see info.token_stats)`;
    const spans = box.querySelectorAll("span.tok");
    for (const span of spans) {
      const i = Number(span.dataset.i);
      const outside = f.masked && !tok.loss_mask[i];
      const v = values && !outside ? values[i] : null;
      const c = colourFor(state.tokenField, v, tok);
      span.style.background = c || "";
      span.classList.toggle("na", !c);
    }
    legend.replaceChildren(...legendFor(state.tokenField));
  }
  const wrap = h("div", {}, h("div", { class: "token-controls panel" }, h("label", {}, "colour by ", sel), legend,
    h("span", { class: "muted", text: `tokenizer: ${tok.tokenizer}` })), notice, box);
  paint();
  return wrap;
}

function legendFor(field) {
  const sw = (c, label) => [h("span", { class: "swatch", style: `background:${c}` }), h("span", { text: label })];
  switch (field) {
    case "loss_mask": return [...sw("#cfe3ff", "1 (sampled: trained on)"), ...sw("#f0f0f0", "0 (prompt / env)")];
    case "logprobs": case "trainer_logprobs": return [...sw("hsl(0,70%,80%)", "p≈0"), ...sw("hsl(60,70%,80%)", "p=0.5"), ...sw("hsl(120,70%,80%)", "p=1"), ...sw("#eeeeee", "n/a")];
    case "is_weights": return [...sw("hsl(220,75%,70%)", "≤0.5"), ...sw("#ffffff", "1"), ...sw("hsl(0,75%,70%)", "≥2")];
    case "is_mask": return [...sw("#c9f0d6", "kept"), ...sw("#f6c4c4", "masked out")];
    case "advantages": return [...sw("hsl(0,70%,68%)", "negative"), ...sw("#ffffff", "0"), ...sw("hsl(140,60%,68%)", "positive")];
    case "versions": return [h("span", { text: "one hue per policy version" })];
  }
  return [];
}

function tokenDetails(tok, i, turns) {
  const line = (k, v) => `${k.padEnd(17)} ${v}`;
  const get = key => (tok[key] ? fmt(tok[key][i], 4) : "n/a");
  const masked = tok.loss_mask[i] === 1;
  return [
    line("token", `#${i}  id ${tok.ids[i]}`),
    line("text", tok.text ? JSON.stringify(tok.text[i]) : "n/a"),
    line("loss mask", String(tok.loss_mask[i])),
    line("turn", tok.turn[i] >= 0 ? String(tok.turn[i]) : "—"),
    line("behaviour logprob", masked ? get("logprobs") : "n/a"),
    line("trainer logprob", masked ? get("trainer_logprobs") : "n/a"),
    line("importance weight", masked ? get("is_weights") : "n/a"),
    line("importance mask", masked ? get("is_mask") : "n/a"),
    line("advantage", masked ? get("advantages") : "n/a"),
    line("policy version", masked ? String(tok.versions[i]) : "n/a"),
    ...(turns.some(x => typeof x.policy === "string")
      ? [line("policy", tok.turn[i] >= 0 && turns[tok.turn[i]] && turns[tok.turn[i]].policy ? turns[tok.turn[i]].policy : "—")] : []),
  ].join("\n");
}

function showTooltip(ev, text) {
  const tip = document.getElementById("tooltip");
  tip.textContent = text;
  tip.hidden = false;
  const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = ev.clientY + 16 + tip.offsetHeight > window.innerHeight ? ev.clientY - tip.offsetHeight - 8 : ev.clientY + 16;
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

function hideTooltip() {
  const tip = document.getElementById("tooltip");
  if (tip) tip.hidden = true;
}

// group -------------------------------------------------------------

async function showGroupPage(groupId) {
  const box = h("div", { id: "group-view" });
  setMain(h("h2", { text: `Group ${groupId}` }), box);
  await fillGroup(box, groupId, null);
}

async function fillGroup(box, groupId, currentId) {
  if (!groupId) { box.replaceChildren(h("p", { class: "muted", text: "This trajectory has no group." })); return; }
  const data = await api(`/api/groups/${encodeURIComponent(groupId)}`);
  const g = data.group || {};
  const rewards = data.members.map(m => m.reward).filter(r => r !== null);
  const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
  const std = rewards.length ? Math.sqrt(rewards.reduce((a, b) => a + (b - mean) ** 2, 0) / rewards.length) : null;
  const cards = data.members.map(m => {
    const adv = m.advantage !== null && m.advantage !== undefined ? m.advantage
      : (mean !== null && m.reward !== null ? (m.reward - mean) / ((std || 0) + 1e-6) : null);
    const computed = m.advantage === null || m.advantage === undefined;
    return h("div", { class: `sibling${m.id === currentId ? " current" : ""}`, dataset: { id: m.id } },
      h("div", {}, h("b", { text: `sample ${m.sample_index}` }), " ", h("a", { href: `#/t/${encodeURIComponent(m.id)}`, text: m.id })),
      h("div", {}, h("span", { class: `badge ${m.reward > 0 ? "good" : "bad"}`, text: `reward ${fmt(m.reward)}` }),
        h("span", { class: "badge", title: computed ? "not stored: computed as (r - mean) / std over the group" : "stored by the trainer", text: `advantage ${fmt(adv)}${computed ? "*" : ""}` }),
        m.error_class ? h("span", { class: "badge bad", text: m.error_class }) : null,
        m.truncated ? h("span", { class: "badge warn", text: "truncated" }) : null),
      (m.policies || []).length || m.agent ? h("div", { class: "seat" }, (m.policies || []).map(p => h("span", { class: "badge policy-badge", text: p })),
        m.agent ? h("span", { class: "muted", text: ` ${m.agent}` }) : null,
        m.outcome ? h("span", { class: `badge ${m.outcome === "win" ? "good" : m.outcome === "loss" ? "bad" : ""}`, text: m.outcome }) : null) : null,
      h("div", { class: "muted", text: `${m.num_tokens} tokens · ${m.num_turns} turns · ${(m.tools || []).join(", ") || "no tools"}` }),
      Object.keys(m.reward_breakdown || {}).length ? h("div", { class: "muted", text: Object.entries(m.reward_breakdown).map(([k, v]) => `${k}=${fmt(v)}`).join("  ") }) : null,
      h("pre", { class: "content", text: m.final }));
  });
  box.replaceChildren(
    h("div", { class: "panel" }, h("div", { class: "meta-grid" }, kv("task", g.task_id), kv("step", fmt(g.step)), kv("status", g.status),
      kv("size", fmt(data.members.length)), kv("reward mean", fmt(mean)), kv("reward std", fmt(std))),
      data.question ? h("pre", { class: "content question", id: "group-question", text: data.question }) : null,
      data.members.some(m => m.advantage === null || m.advantage === undefined)
        ? h("p", { class: "muted", text: "* advantage not stored by the trainer: shown as the GRPO estimate (r − mean) / std." }) : null),
    h("div", { class: "siblings", id: "siblings" }, cards));
}

// ------------------------------------------------------------------ start

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", async () => {
  await refreshRun();
  await route();
  state.timer = setInterval(async () => {
    const before = state.run ? state.run.count : null;
    await refreshRun();
    if (!state.run || before === null || state.run.count === before) return;
    const { parts } = parseHash();
    if (!parts.length || parts[0] === "overview") route();
    else if (parts[0] === "list" && !document.getElementById("new-data")) {
      // never reshuffle a list the user is reading: offer the refresh instead
      const pager = document.querySelector(".pager");
      if (pager) pager.appendChild(h("button", { id: "new-data", onclick: route }, "new trajectories arrived: refresh"));
    }
  }, 4000);
});
