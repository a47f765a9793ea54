// Arbor dashboard: renders the updates of /dashboard/events (server-sent events, about two a
// second). Plain JavaScript modules, no libraries, nothing loaded from elsewhere.
import { HISTORY, drawBars, drawLine, drawStacked } from "./charts.js";
import { $, el, fmtAge, fmtInt, fmtMs, fmtPct, requestName, setText } from "./format.js";
import { attachTooltip } from "./tooltip.js";
import { nodeById, renderTree, selectRequest, selectedRid } from "./tree.js";

const view = {
  previous: null, // the previous update, for rates
  history: { hit: [], kv: [], evictions: [] },
  requests: [],
};

function connect() {
  const source = new EventSource("dashboard/events");
  source.onopen = () => setConnection("live", "live");
  source.onerror = () => setConnection("retrying", "reconnecting…");
  source.onmessage = (event) => {
    const update = JSON.parse(event.data);
    showError(update.error ?? null);
    if (!update.error) render(update);
  };
}

function setConnection(state, text) {
  const node = $("connection");
  node.dataset.state = state;
  node.textContent = text;
}

function showError(message) {
  const banner = $("error");
  banner.hidden = message == null;
  if (message != null) banner.textContent = message;
}

function render(update) {
  setText("model", update.model);
  setText("updated", "updated " + new Date(update.time * 1000).toLocaleTimeString("en-GB"));
  const rates = ratesSince(view.previous, update);
  renderCache(update, rates);
  renderScheduler(update, rates);
  view.requests = update.tree.requests || [];
  renderTree(update.tree, view.requests);
  renderRequests(update.time);
  view.previous = update;
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

// Rates over the time between two updates (null for the first, or without a tree).
function ratesSince(before, now) {
  if (!before || !before.tree.enabled || !now.tree.enabled) return null;
  const dt = now.time - before.time;
  if (dt <= 0) return null;
  const a = before.server_info;
  const b = now.server_info;
  const prompts = b.prompt_tokens - a.prompt_tokens;
  const evicted = now.tree.stats.evicted_tokens - before.tree.stats.evicted_tokens;
  return {
    hitRate: prompts > 0 ? (b.cached_tokens - a.cached_tokens) / prompts : null,
    evictedPerS: Math.max(evicted, 0) / dt,
    tokensPerS: Math.max(b.generated_tokens - a.generated_tokens, 0) / dt,
  };
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function renderCache(update, rates) {
  const info = update.server_info;
  const capacity = info.max_total_tokens;
  const evictable = update.tree.enabled ? update.tree.stats.evictable_tokens : 0;
  setText("hit-rate", fmtPct(info.cache_hit_rate));
  setText("kv-used", fmtInt(info.kv_used_tokens));
  setText("kv-evictable", fmtInt(evictable));
  setText("kv-free", fmtInt(info.kv_free_tokens));
  setText("evictions", rates ? fmtInt(rates.evictedPerS) : "–");
  setText(
    "kv-disk",
    info.kv_disk_path ? `${fmtInt(info.kv_disk_hits_tokens)}, ${fmtInt(info.kv_disk_writes)}` : "off",
  );
  push(view.history.hit, rates ? rates.hitRate : null);
  push(view.history.kv, [
    info.kv_used_tokens / capacity,
    evictable / capacity,
    info.kv_free_tokens / capacity,
  ]);
  push(view.history.evictions, rates ? rates.evictedPerS : 0);
  drawLine($("chart-hit"), view.history.hit, "#3b5bdb", 1, fmtPct);
  drawStacked($("chart-kv"), view.history.kv, ["#d9822b", "#2f8f5b", "#dfe3ea"]);
  drawBars($("chart-evict"), view.history.evictions.map((v) => [v]), ["#c0392b"], null, fmtInt);
}

function renderScheduler(update, rates) {
  const info = update.server_info;
  setText("running", fmtInt(info.num_running_reqs));
  setText("waiting", fmtInt(info.num_waiting_reqs));
  setText("grammar-queue", fmtInt(info.num_grammar_queue_reqs));
  setText("retractions", fmtInt(info.num_retracted_reqs));
  setText("throughput", rates ? fmtInt(rates.tokensPerS) : "–");
  for (const kind of ["ttft", "itl"]) {
    const p = update.latency[kind];
    for (const q of ["p50", "p90", "p99"]) setText(`${kind}-${q}`, p ? fmtMs(p[q]) : "–");
  }
  const steps = update.steps.slice(-HISTORY);
  drawBars(
    $("chart-steps"),
    steps.map((s) => [s.prefill_tokens, s.decode_rows]),
    ["#3b5bdb", "#2f8f5b"],
    steps.map((s) => s.retracted > 0),
    fmtInt,
  );
}

function renderRequests(now) {
  const rows = view.requests
    .slice()
    .reverse()
    .map((r) => {
      const row = el("tr");
      row.dataset.rid = r.rid;
      row.classList.toggle("selected", r.rid === selectedRid());
      const reason = r.finish_reason;
      const finish = !reason ? "–" : reason.status_code ? `error ${reason.status_code}` : reason.type;
      const cells = [
        requestName(r),
        fmtInt(r.prompt_tokens),
        fmtInt(r.cached_tokens),
        fmtInt(r.completion_tokens),
        finish,
        r.latency_s.toFixed(2) + " s",
        fmtAge(now - r.finished_at),
      ];
      for (const value of cells) row.append(el("td", null, value));
      row.firstChild.title = r.id === r.rid ? r.rid : `${r.id} (${r.rid})`;
      return row;
    });
  $("requests").tBodies[0].replaceChildren(...rows);
}

function onRequestClick(event) {
  const row = event.target.closest("tr[data-rid]");
  if (!row) return;
  selectRequest(row.dataset.rid);
  if (view.previous) {
    renderTree(view.previous.tree, view.requests);
    renderRequests(view.previous.time);
  }
}

attachTooltip($("tree"), nodeById);
$("requests").addEventListener("click", onRequestClick);
connect();
