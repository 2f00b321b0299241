// Shoal's page: chat with a model (streamed), the live engines table, inference and
// download status from the WebSocket, and throughput/TTFT from /metrics. No framework:
// a few tables and one chart are less code than a library's set-up, and nothing here
// needs a build step or the network.
"use strict";

const base = location.pathname.replace(/\/ui\/?$/, "");
const $ = (id) => document.getElementById(id);
const keyInput = $("apikey");
keyInput.value = localStorage.getItem("shoal.apikey") || "";
keyInput.addEventListener("change", () => {
  localStorage.setItem("shoal.apikey", keyInput.value);
  connect();
  refresh();
});

function headers(extra = {}) {
  const h = { ...extra };
  if (keyInput.value) h.Authorization = `Bearer ${keyInput.value}`;
  return h;
}

async function getJSON(path) {
  const r = await fetch(base + path, { headers: headers() });
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    tr.append(...cells);
    return tr;
  }));
}

// ---- models and chat ---------------------------------------------------------------
async function loadModels() {
  const select = $("model");
  const chosen = select.value;
  const { data } = await getJSON("/v1/models");
  select.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
  if (chosen && data.some((m) => m.id === chosen)) select.value = chosen;
}

const history = [];

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

async function chat(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("prompt").value = "";
  $("send").disabled = true;
  history.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const out = addMessage("assistant", "");
  try {
    const r = await fetch(base + "/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model: $("model").value, messages: history, stream: true, max_tokens: 256 }),
    });
    if (!r.ok) throw new Error((await r.json()).error?.message || r.statusText);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = frame.replace(/^data: ?/, "");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        out.textContent += chunk.choices?.[0]?.delta?.content || "";
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
    history.push({ role: "assistant", content: out.textContent });
  } catch (err) {
    out.className = "msg error";
    out.textContent = String(err.message || err);
    history.pop();
  } finally {
    $("send").disabled = false;
  }
}

$("ask").addEventListener("submit", chat);
$("clear").addEventListener("click", () => { history.length = 0; $("log").replaceChildren(); });

// ---- engines -----------------------------------------------------------------------
async function loadEngines() {
  const { engines } = await getJSON("/engines");
  fillTable("engines", engines.map((e) => {
    const i = e.runtime_info || {};
    return [
      cell(e.engine_name), cell(e.engine_id.slice(0, 8)), cell((e.node_id || "").slice(0, 8)),
      cell(i.num_running ?? "", "num"), cell(i.num_waiting ?? "", "num"),
      cell(i.kv_usage === undefined ? "" : `${(100 * i.kv_usage).toFixed(1)} %`, "num"),
      cell(i.tokens_per_s ?? "", "num"),
    ];
  }));
}

// ---- downloads and inference, from the WebSocket -------------------------------------
const downloads = new Map();
const inference = new Map();

function showDownloads() {
  fillTable("downloads", [...downloads.values()].map((d) => {
    const bar = document.createElement("progress");
    bar.max = 1;
    bar.value = d.progress;
    const td = document.createElement("td");
    td.append(bar);
    return [cell(d.modelRepo), cell(d.filePath || "(all)"), cell(d.status), td, cell(d.downloadSpeed)];
  }));
}

function showInference() {
  fillTable("inference", [...inference.values()].map((w) => [
    cell(w.alias), cell(w.status), cell(w.modelRepo), cell(w.error),
  ]));
}

let socket = null;

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function connect() {
  if (socket) socket.close();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  // The key travels as a subprotocol, never in the URL (proxies and access logs keep URLs).
  const protocols = ["shoal.events"];
  if (keyInput.value) protocols.push(`shoal.key.${base64url(keyInput.value)}`);
  socket = new WebSocket(`${scheme}://${location.host}${base}/ws`, protocols);
  const mine = socket;
  socket.onopen = () => { $("conn").textContent = "live"; $("conn").className = "badge on"; };
  socket.onclose = () => {
    if (socket !== mine) return;
    $("conn").textContent = "offline";
    $("conn").className = "badge off";
    setTimeout(connect, 2000);
  };
  socket.onmessage = (message) => {
    const { event, data } = JSON.parse(message.data);
    if (event === "download_status") {
      const key = `${data.modelRepo}|${data.filePath}`;
      if (data.status === "idle") downloads.delete(key); else downloads.set(key, data);
      showDownloads();
    } else if (event === "inference_status") {
      inference.set(data.alias, data);
      showInference();
      if (data.status === "inferring" || data.status === "complete") loadModels().catch(() => {});
    } else if (event === "metrics") {
      loadEngines().catch(() => {});
    } else if (event === "status") {
      $("conn").textContent = data.state;
    }
  };
}

// ---- throughput and TTFT from /metrics -------------------------------------------------
const points = [];  // {tps, ttftMs}
let previous = null;

function metricSum(text, name) {
  let total = 0;
  for (const line of text.split("\n")) {
    if (line.startsWith(name + "{") || line.startsWith(name + " ")) {
      total += parseFloat(line.slice(line.lastIndexOf(" ") + 1)) || 0;
    }
  }
  return total;
}

async function sampleMetrics() {
  const r = await fetch(base + "/metrics", { headers: headers() });
  if (!r.ok) return;
  const text = await r.text();
  const now = {
    t: performance.now() / 1000,
    tokens: metricSum(text, "shoal_generation_tokens_total"),
    ttftSum: metricSum(text, "shoal_time_to_first_token_seconds_sum"),
    ttftCount: metricSum(text, "shoal_time_to_first_token_seconds_count"),
  };
  if (previous) {
    const dt = now.t - previous.t;
    const n = now.ttftCount - previous.ttftCount;
    const last = points.length ? points[points.length - 1].ttftMs : 0;
    points.push({
      tps: Math.max(0, (now.tokens - previous.tokens) / dt),
      ttftMs: n > 0 ? (1000 * (now.ttftSum - previous.ttftSum)) / n : last,
    });
    if (points.length > 60) points.shift();
    drawChart();
  }
  previous = now;
}

const SVG = "http://www.w3.org/2000/svg";

function series(values, max, color) {
  const step = 400 / 59;
  const xy = values.map((v, i) => [i * step + 3, 116 - (108 * v) / max]);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", xy.map(([x, y]) => `${x},${y}`).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", color);
  line.setAttribute("stroke-width", "2");
  const dots = xy.map(([x, y]) => {
    const dot = document.createElementNS(SVG, "circle");
    dot.setAttribute("cx", x);
    dot.setAttribute("cy", y);
    dot.setAttribute("r", "2.5");
    dot.setAttribute("fill", color);
    return dot;
  });
  return [line, ...dots];
}

function drawChart() {
  const tps = points.map((p) => p.tps);
  const ttft = points.map((p) => p.ttftMs);
  $("chart").replaceChildren(
    ...series(tps, Math.max(1, ...tps), "#1769e0"),
    ...series(ttft, Math.max(1, ...ttft), "#d9534f"),
  );
  $("chart").dataset.points = points.length;
  const last = points[points.length - 1];
  $("figures").textContent = `now: ${last.tps.toFixed(1)} tok/s, TTFT ${last.ttftMs.toFixed(0)} ms`;
}

function refresh() {
  loadModels().catch(() => {});
  loadEngines().catch(() => {});
}

refresh();
connect();
setInterval(() => loadEngines().catch(() => {}), 3000);
setInterval(() => sampleMetrics().catch(() => {}), 2000);
