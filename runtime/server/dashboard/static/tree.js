// The radix tree panel: one row per node of the snapshot, reused across updates, with folded
// and just-evicted nodes, and the path of the selected request highlighted.
import { $, el, fmtAge, fmtInt, namespaceName, oneLine, requestName, setText } from "./format.js";

const INDENT_PX = 16;
const STATES = ["root", "locked", "evictable", "evicted"];
const FRESH_MS = 800; // as long as the "fresh" animation in dashboard.css
const GHOSTS_PER_NODE = 3; // just-evicted children listed under one node (the rest counted)
const ELSEWHERE = -1; // stands for the parents of just-evicted nodes that are not listed

const state = {
  rows: new Map(), // key -> row element
  nodes: new Map(), // node id -> node of the latest update
  rendered: false,
  selected: null, // rid of the request whose path is highlighted
  selectedRecord: null, // its latest record (kept after it leaves the recent requests)
  scrollToPath: false,
};

export const nodeById = (id) => state.nodes.get(id);
export const selectedRid = () => state.selected;

// Select the request ``rid`` (or unselect it if it was selected); the next render shows its path.
export function selectRequest(rid) {
  state.selected = state.selected === rid ? null : rid;
  state.selectedRecord = null;
  state.scrollToPath = state.selected != null;
}

export function renderTree(tree, requests) {
  const container = $("tree");
  if (!tree.enabled) {
    setText("tree-summary", "the radix cache is disabled (--disable-radix-cache)");
    container.replaceChildren();
    return;
  }
  const nodes = tree.nodes;
  state.nodes = new Map(nodes.map((n) => [n.id, n]));
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
    const parent = state.nodes.has(g.parent) || evictedIds.has(g.parent) ? g.parent : ELSEWHERE;
    if (!ghosts.has(parent)) ghosts.set(parent, []);
    ghosts.get(parent).push(g);
  }
  const highlighted = pathHighlight(requests);
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
      const where = parentId === ELSEWHERE ? "more under nodes not shown" : "more";
      const text = evictedNote(gone.slice(GHOSTS_PER_NODE), where);
      wanted.push(noteRow(`evicted-more:${parentId}`, depth, text));
    }
  };
  const visit = (n, depth) => {
    wanted.push(nodeRow(n, depth, total, highlighted.has(n.id)));
    for (const c of children.get(n.id) || []) visit(c, depth + 1);
    visitGhosts(n.id, depth + 1);
    if (n.folded_children > 0) {
      const more = n.folded_children === 1 ? "1 more branch" : `${n.folded_children} more branches`;
      const text = `+ ${more} folded · ${fmtInt(n.folded_tokens)} tokens`;
      wanted.push(noteRow(`fold:${n.id}`, depth + 1, text));
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
  state.rendered = true;
  if (state.scrollToPath) {
    state.scrollToPath = false;
    const rows = container.querySelectorAll(".node.on-path");
    if (rows.length) rows[rows.length - 1].scrollIntoView({ block: "nearest" });
  }
}

// Make the container's children ``wanted``, in order, reusing the rows it has: drop the
// others first, then move only the rows out of place.
function reconcile(container, wanted) {
  const keep = new Set(wanted);
  for (const row of [...container.children]) if (!keep.has(row)) row.remove();
  for (const [key, row] of state.rows) if (!keep.has(row)) state.rows.delete(key);
  wanted.forEach((row, i) => {
    if (container.children[i] !== row) container.insertBefore(row, container.children[i] || null);
  });
}

function rowFor(key, build) {
  let row = state.rows.get(key);
  if (!row) {
    row = build();
    if (state.rendered) {
      // A new node flashes once (moving the row would restart an animation left on it).
      row.classList.add("fresh");
      setTimeout(() => row.classList.remove("fresh"), FRESH_MS);
    }
    state.rows.set(key, row);
  }
  return row;
}

function nodeRow(n, depth, total, onPath) {
  const row = rowFor((n.state === "evicted" ? "evicted:" : "node:") + n.id, () => {
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
  for (const s of STATES) row.classList.toggle(s, s === n.state);
  row.classList.toggle("shared", n.children >= 2);
  row.classList.toggle("on-path", onPath);
  const [tokens, lead, text, meta, bar] = row.children;
  lead.firstChild.style.width = depth * INDENT_PX + "px";
  lead.lastChild.className = "dot " + n.state;
  const root = n.state === "root";
  tokens.textContent = `${fmtInt(root ? n.subtree_tokens : n.tokens)} tok`;
  text.textContent = root
    ? `${namespaceName(n)} · its cached prefixes start here`
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
function pathHighlight(requests) {
  const ids = new Set();
  const listed = requests.find((r) => r.rid === state.selected);
  if (listed) state.selectedRecord = listed;
  const request = state.selected == null ? null : state.selectedRecord;
  const note = $("path-note");
  if (!request) {
    note.hidden = true;
    return ids;
  }
  const shown = request.path.filter((id) => state.nodes.has(id));
  let node = state.nodes.get(shown[shown.length - 1]);
  while (node) {
    ids.add(node.id);
    node = state.nodes.get(node.parent);
  }
  const total = request.prompt_tokens + request.completion_tokens;
  const count = request.path.length;
  let text =
    `${requestName(request)}: ${count} node${count === 1 ? "" : "s"} ` +
    `held ${fmtInt(request.path_tokens)} of its ${fmtInt(total)} tokens`;
  if (request.path_evicted) text += `; ${request.path_evicted} evicted since`;
  const hidden = count - shown.length - request.path_evicted;
  if (hidden > 0) text += `; ${hidden} folded out of view`;
  if (!listed) text += " (no longer among the recent requests; its path as last listed)";
  note.textContent = text;
  note.hidden = false;
  return ids;
}
