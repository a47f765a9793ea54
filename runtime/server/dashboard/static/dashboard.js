// Arbor dashboard: renders the updates of /dashboard/events (server-sent events, about two a
// second). Plain JavaScript, no libraries, nothing loaded from elsewhere. Text that comes from
// the model or the callers is only ever set as textContent.
"use strict";

(() => {
  const HISTORY = 120; // chart points kept: a minute at two updates a second
  const INDENT_PX = 16;
  const STATES = ["root", "locked", "evictable", "evicted"];
  const HOVER_DELAY_MS = 150;
  const FRESH_MS = 800; // as long as the "fresh" animation in dashboard.css
  const GHOSTS_PER_NODE = 3; // just-evicted children listed under one node (the rest counted)
  const ELSEWHERE = -1; // stands for the parents of just-evicted nodes that are not listed

  const $ = (id) => document.getElementById(id);
  const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
  const fmtPct = (x) => (x == null ? "–" : (100 * x).toFixed(1) + "%");
  const fmtMs = (s) => {
    if (s == null) return "–";
    const ms = 1000 * s;
    return (ms < 10 ? ms.toFixed(2) : ms < 100 ? ms.toFixed(1) : ms.toFixed(0)) + " ms";
  };
  const fmtAge = (s) => {
    if (s == null) return "long ago";
    if (s < 1) return "now";
    if (s < 60) return s.toFixed(0) + " s ago";
    if (s < 3600) return (s / 60).toFixed(0) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  };
  // A request's name: the caller's rid, or "#n" for the server's own id "<instance>-n".
  const requestName = (r) => (r.id === r.rid ? "#" + r.rid.split("-").pop() : r.id);
  // One line of decoded text with its line breaks and tabs made visible.
  const oneLine = (text) => text.replace(/\r?\n/g, "↵").replace(/\t/g, "⇥");

  const view = {
    previous: null, // the previous update, for rates
    history: { hit: [], kv: [], evictions: [] },
    rows: new Map(), // key -> row element of the tree
    nodes: new Map(), // node id -> node of the latest update
    rendered: false,
    selected: null, // rid of the request whose path is highlighted
    selectedRecord: null, // its latest record (kept after it leaves the recent requests)
    scrollToPath: false,
    requests: [],
    prefixes: new Map(), // "id:tokens" -> the /cache_tree/prefix answer
    hoverTimer: null,
    hovered: null,
  };

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text != null) node.textContent = text;
    return node;
  }

  function setText(id, text) {
    const node = $(id);
    if (node.textContent !== text) node.textContent = text;
  }

  // ---- the stream ------------------------------------------------------------------------

  function connect() {
    const source = new EventSource("dashboard/events");
    source.onopen = () => setConnection("live", "live");
    source.onerror = () => setConnection("retrying", "reconnecting…");
    source.onmessage = (event) => {
      const update = JSON.parse(event.data);
      if (update.error) {
        showError(update.error);
        return;
      }
      showError(null);
      render(update);
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
    renderTree(update.tree);
    renderRequests(update.time);
    view.previous = update;
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  // Rates over the time between two updates (null for the first, or after a reset).
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

  // ---- cache and memory ------------------------------------------------------------------

  function renderCache(update, rates) {
    const info = update.server_info;
    const capacity = info.max_total_tokens;
    const evictable = update.tree.enabled ? update.tree.stats.evictable_tokens : 0;
    setText("hit-rate", fmtPct(info.cache_hit_rate));
    setText("kv-used", fmtInt(info.kv_used_tokens));
    setText("kv-evictable", fmtInt(evictable));
    setText("kv-free", fmtInt(info.kv_free_tokens));
    setText("evictions", rates ? fmtInt(rates.evictedPerS) : "–");
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

  // ---- the scheduler ---------------------------------------------------------------------

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

  // ---- charts (canvas) -------------------------------------------------------------------

  function surface(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const height = Number(canvas.getAttribute("height"));
    const width = canvas.clientWidth;
    if (!canvas.dataset.height) canvas.dataset.height = String(height);
    const cssHeight = Number(canvas.dataset.height);
    canvas.style.height = cssHeight + "px";
    canvas.width = Math.max(1, Math.round(width * ratio));
    canvas.height = Math.round(cssHeight * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, cssHeight);
    ctx.strokeStyle = "#e2e5eb";
    ctx.strokeRect(0.5, 0.5, width - 1, cssHeight - 1);
    return { ctx, width, height: cssHeight };
  }

  function label(ctx, text) {
    ctx.fillStyle = "#6b7385";
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillText(text, 4, 11);
  }

  function drawLine(canvas, values, color, max, format) {
    const { ctx, width, height } = surface(canvas);
    const offset = HISTORY - values.length; // the newest point at the right edge
    const x = (i) => (width * (i + offset)) / (HISTORY - 1);
    const y = (v) => height - 2 - ((height - 14) * v) / max;
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let drawing = false;
    values.forEach((v, i) => {
      if (v == null) {
        drawing = false;
        return;
      }
      if (drawing) ctx.lineTo(x(i), y(v));
      else ctx.moveTo(x(i), y(v));
      drawing = true;
    });
    ctx.stroke();
    label(ctx, format(max));
  }

  function drawStacked(canvas, rows, colors) {
    const { ctx, width, height } = surface(canvas);
    const step = width / HISTORY;
    const offset = HISTORY - rows.length;
    rows.forEach((parts, i) => {
      let top = height;
      parts.forEach((share, k) => {
        const h = Math.max(share, 0) * height;
        ctx.fillStyle = colors[k];
        ctx.fillRect((i + offset) * step, top - h, Math.ceil(step), h);
        top -= h;
      });
    });
    label(ctx, "100%");
  }

  function drawBars(canvas, rows, colors, marks, format) {
    const { ctx, width, height } = surface(canvas);
    const max = Math.max(1, ...rows.map((parts) => parts.reduce((a, b) => a + b, 0)));
    const step = width / HISTORY;
    const offset = HISTORY - rows.length;
    rows.forEach((parts, i) => {
      const x = (i + offset) * step;
      let top = height - 1;
      parts.forEach((value, k) => {
        const h = ((height - 14) * value) / max;
        ctx.fillStyle = colors[k];
        ctx.fillRect(x + 1, top - h, Math.max(step - 2, 1), h);
        top -= h;
      });
      if (marks && marks[i]) {
        ctx.fillStyle = "#c0392b";
        ctx.fillRect(x, 12, Math.max(step - 1, 2), 3);
      }
    });
    label(ctx, format(max));
  }

  // ---- the radix tree --------------------------------------------------------------------

  function renderTree(tree) {
    const container = $("tree");
    if (!tree.enabled) {
      setText("tree-summary", "the radix cache is disabled (--disable-radix-cache)");
      container.replaceChildren();
      return;
    }
    const nodes = tree.nodes;
    view.nodes = new Map(nodes.map((n) => [n.id, n]));
    const children = new Map();
    for (const n of nodes) {
      if (n.parent == null) continue;
      if (!children.has(n.parent)) children.set(n.parent, []);
      children.get(n.parent).push(n);
    }
    // Just-evicted nodes hang under their parent when it is shown or just evicted too; those
    // whose parent is neither go at the end. A few per parent are listed, the rest counted.
    const evictedIds = new Set(tree.recently_evicted.map((g) => g.id));
    const ghosts = new Map([[ELSEWHERE, []]]);
    for (const g of tree.recently_evicted) {
      const parent = view.nodes.has(g.parent) || evictedIds.has(g.parent) ? g.parent : ELSEWHERE;
      if (!ghosts.has(parent)) ghosts.set(parent, []);
      ghosts.get(parent).push(g);
    }
    const highlighted = pathHighlight();
    const stats = tree.stats;
    const total = Math.max(stats.cached_tokens, 1);
    const wanted = [];
    const visitGhosts = (parentId, depth) => {
      const gone = ghosts.get(parentId) || [];
      for (const g of gone.slice(0, GHOSTS_PER_NODE)) {
        wanted.push(nodeRow(g, depth, total, false));
        visitGhosts(g.id, depth + 1);
      }
      if (gone.length > GHOSTS_PER_NODE) {
        const more = gone.slice(GHOSTS_PER_NODE);
        const where = parentId === ELSEWHERE ? "more under nodes not shown" : "more";
        wanted.push(noteRow(`evicted-more:${parentId}`, depth, evictedNote(more, where)));
      }
    };
    const visit = (n, depth) => {
      wanted.push(nodeRow(n, depth, total, highlighted.has(n.id)));
      for (const c of children.get(n.id) || []) visit(c, depth + 1);
      visitGhosts(n.id, depth + 1);
      if (n.folded_children > 0) {
        const more = n.folded_children === 1 ? "1 more branch" : `${n.folded_children} more branches`;
        wanted.push(noteRow(`fold:${n.id}`, depth + 1, `+ ${more} folded · ${fmtInt(n.folded_tokens)} tokens`));
      }
    };
    for (const n of nodes) if (n.parent == null) visit(n, 0);
    visitGhosts(ELSEWHERE, 1);
    reconcile(container, wanted);
    setText(
      "tree-summary",
      `${fmtInt(stats.cached_tokens)} tokens cached in ${fmtInt(stats.nodes)} nodes · ` +
        `showing ${fmtInt(tree.shown_nodes)} nodes; ${fmtInt(tree.folded_tokens)} tokens ` +
        `folded · snapshot took the scheduler ${tree.snapshot_ms.toFixed(2)} ms`,
    );
    view.rendered = true;
    if (view.scrollToPath) {
      view.scrollToPath = false;
      const rows = container.querySelectorAll(".node.on-path");
      if (rows.length) rows[rows.length - 1].scrollIntoView({ block: "nearest" });
    }
  }

  // Make the container's children ``wanted``, in order, reusing the rows it has: drop the
  // others first, then move only the rows out of place.
  function reconcile(container, wanted) {
    const keep = new Set(wanted);
    for (const row of [...container.children]) if (!keep.has(row)) row.remove();
    for (const [key, row] of view.rows) if (!keep.has(row)) view.rows.delete(key);
    wanted.forEach((row, i) => {
      if (container.children[i] !== row) container.insertBefore(row, container.children[i] || null);
    });
  }

  function rowFor(key, build) {
    let row = view.rows.get(key);
    if (!row) {
      row = build();
      if (view.rendered) {
        // A new node flashes once (moving the row would restart an animation left on it).
        row.classList.add("fresh");
        setTimeout(() => row.classList.remove("fresh"), FRESH_MS);
      }
      view.rows.set(key, row);
    }
    return row;
  }

  function nodeRow(n, depth, total, onPath) {
    const ghost = n.state === "evicted";
    const row = rowFor((ghost ? "evicted:" : "node:") + n.id, () => {
      const r = el("div", "node");
      r.setAttribute("role", "treeitem");
      const lead = el("span", "lead");
      lead.append(el("span", "indent"), el("i", "dot"));
      r.append(el("span", "tokens"), lead, el("span", "text"), el("span", "meta"), el("div", "bar"));
      return r;
    });
    row.dataset.nodeId = String(n.id);
    row.dataset.tokens = String(n.tokens);
    row.dataset.state = n.state;
    for (const state of STATES) row.classList.toggle(state, state === n.state);
    row.classList.toggle("shared", n.children >= 2);
    row.classList.toggle("on-path", onPath);
    const [tokens, lead, text, meta, bar] = row.children;
    lead.firstChild.style.width = depth * INDENT_PX + "px";
    lead.lastChild.className = "dot " + n.state;
    const root = n.state === "root";
    tokens.textContent = root ? `${fmtInt(n.subtree_tokens)} tok` : `${fmtInt(n.tokens)} tok`;
    text.textContent = root
      ? "namespace root · all cached prefixes start here"
      : oneLine(n.text) + (n.elided_tokens > 0 || n.tail_text ? " …" : "");
    meta.replaceChildren(...metaParts(n));
    bar.style.width = ((100 * n.subtree_tokens) / total).toFixed(2) + "%";
    return row;
  }

  function metaParts(n) {
    const parts = [];
    if (n.children >= 2) parts.push(el("span", "branch", `${n.children} branches`));
    if (n.state === "evicted") {
      parts.push(el("span", null, `evicted ${fmtAge(n.evicted_s_ago)}`));
      return parts;
    }
    if (n.state === "root") return parts;
    if (n.locks > 0) parts.push(el("span", null, `${n.locks} running`));
    parts.push(el("span", null, `${fmtInt(n.hits)} hit${n.hits === 1 ? "" : "s"}`));
    parts.push(el("span", null, fmtAge(n.last_access_s)));
    return parts;
  }

  // A line in the tree that stands for nodes not listed (folded, or evicted too many to list).
  function noteRow(key, depth, text) {
    const row = rowFor(key, () => {
      const r = el("div", "fold");
      const lead = el("span", "lead");
      lead.append(el("span", "indent"));
      r.append(el("span", null), lead, el("span", null), el("span", null));
      return r;
    });
    row.children[1].firstChild.style.width = depth * INDENT_PX + "px";
    row.children[2].textContent = text;
    return row;
  }

  function evictedNote(gone, where) {
    const tokens = gone.reduce((sum, g) => sum + g.tokens, 0);
    const nodes = gone.length === 1 ? "1 node" : `${gone.length} nodes`;
    return `− ${nodes} ${where} just evicted · ${fmtInt(tokens)} tokens`;
  }

  // Node ids to highlight for the selected request: its path's nodes still shown, and the
  // ancestors of the deepest of them (a split puts new nodes above a path's nodes).
  function pathHighlight() {
    const ids = new Set();
    const listed = view.requests.find((r) => r.rid === view.selected);
    if (listed) view.selectedRecord = listed;
    const request = view.selected == null ? null : view.selectedRecord;
    const note = $("path-note");
    if (!request) {
      note.hidden = true;
      return ids;
    }
    const shown = request.path.filter((id) => view.nodes.has(id));
    let node = view.nodes.get(shown[shown.length - 1]);
    while (node) {
      ids.add(node.id);
      node = view.nodes.get(node.parent);
    }
    const total = request.prompt_tokens + request.completion_tokens;
    let text =
      `${requestName(request)}: ${request.path.length} node${request.path.length === 1 ? "" : "s"} ` +
      `held ${fmtInt(request.path_tokens)} of its ${fmtInt(total)} tokens`;
    if (request.path_evicted) text += `; ${request.path_evicted} evicted since`;
    const hidden = request.path.length - shown.length - request.path_evicted;
    if (hidden > 0) text += `; ${hidden} folded out of view`;
    if (!listed) text += " (no longer among the recent requests; its path as last listed)";
    note.textContent = text;
    note.hidden = false;
    return ids;
  }

  // ---- recent requests -------------------------------------------------------------------

  function renderRequests(now) {
    const body = $("requests").tBodies[0];
    const rows = view.requests
      .slice()
      .reverse()
      .map((r) => {
        const row = el("tr");
        row.dataset.rid = r.rid;
        row.classList.toggle("selected", r.rid === view.selected);
        const reason = r.finish_reason;
        const finish = !reason
          ? "–"
          : reason.status_code
            ? `error ${reason.status_code}`
            : reason.type;
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
    body.replaceChildren(...rows);
  }

  function onRequestClick(event) {
    const row = event.target.closest("tr[data-rid]");
    if (!row) return;
    view.selected = view.selected === row.dataset.rid ? null : row.dataset.rid;
    view.selectedRecord = null;
    view.scrollToPath = view.selected != null;
    if (view.previous) {
      renderTree(view.previous.tree);
      renderRequests(view.previous.time);
    }
  }

  // ---- hover: the whole prefix of a node --------------------------------------------------

  function onTreeOver(event) {
    const row = event.target.closest(".node");
    if (!row || row === view.hovered) return;
    view.hovered = row;
    clearTimeout(view.hoverTimer);
    view.hoverTimer = setTimeout(() => showPrefix(row, event.clientX, event.clientY), HOVER_DELAY_MS);
  }

  function onTreeOut(event) {
    const row = event.target.closest(".node");
    if (row && row.contains(event.relatedTarget)) return;
    view.hovered = null;
    clearTimeout(view.hoverTimer);
    $("tooltip").hidden = true;
  }

  async function showPrefix(row, x, y) {
    const id = Number(row.dataset.nodeId);
    const n = view.nodes.get(id);
    const tip = $("tooltip");
    const head = el("div", "head");
    const body = el("pre");
    tip.replaceChildren(head, body);
    if (!n || n.state === "root") {
      head.textContent = "namespace root: every cached prefix starts here";
      body.textContent = "";
    } else {
      head.textContent =
        `${fmtInt(n.tokens)} tokens after ${fmtInt(n.prefix_tokens)} · ${n.state}` +
        (n.locks ? ` by ${n.locks} running` : "") +
        ` · ${fmtInt(n.hits)} hits · ${fmtAge(n.last_access_s)}`;
      body.textContent = nodeText(n);
    }
    place(tip, x, y);
    if (!n || n.state === "root") return;
    const prefix = await fetchPrefix(n);
    if (view.hovered !== row) return;
    if (prefix.error) {
      head.textContent += ` · whole prefix unavailable: ${prefix.error}`;
      return;
    }
    head.textContent = `whole prefix, ${fmtInt(prefix.tokens)} tokens; this node's ` +
      `${fmtInt(n.tokens)} highlighted`;
    body.replaceChildren(prefix.above_text, el("mark", null, prefix.node_text));
    place(tip, x, y);
  }

  function nodeText(n) {
    if (n.elided_tokens > 0) return `${n.text} … ${fmtInt(n.elided_tokens)} tokens … ${n.tail_text}`;
    return n.text + n.tail_text;
  }

  async function fetchPrefix(n) {
    const key = `${n.id}:${n.tokens}`;
    if (view.prefixes.has(key)) return view.prefixes.get(key);
    let answer;
    try {
      const response = await fetch(`cache_tree/prefix?node=${n.id}`);
      const body = await response.json();
      answer = response.ok ? body : { error: body.error ? body.error.message : response.status };
    } catch (error) {
      answer = { error: String(error) };
    }
    if (!answer.error) {
      if (view.prefixes.size > 500) view.prefixes.clear();
      view.prefixes.set(key, answer);
    }
    return answer;
  }

  function place(tip, x, y) {
    tip.hidden = false;
    const pad = 14;
    const left = Math.min(x + pad, window.innerWidth - tip.offsetWidth - pad);
    const top = y + pad + tip.offsetHeight > window.innerHeight ? y - tip.offsetHeight - pad : y + pad;
    tip.style.left = Math.max(pad, left) + "px";
    tip.style.top = Math.max(pad, top) + "px";
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("tree").addEventListener("mouseover", onTreeOver);
    $("tree").addEventListener("mouseout", onTreeOut);
    $("requests").addEventListener("click", onRequestClick);
    connect();
  });
})();
