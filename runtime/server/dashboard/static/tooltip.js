// Hovering a node of the tree shows its whole prefix, from the root, with the node's own part
// highlighted (fetched from /cache_tree/prefix and remembered).
import { $, el, fmtAge, fmtInt, namespaceName } from "./format.js";

const HOVER_DELAY_MS = 150;
const REMEMBERED = 500;

const state = { timer: null, hovered: null, prefixes: new Map() };

// ``lookup(id)``: the node of the latest update with that id.
export function attachTooltip(container, lookup) {
  container.addEventListener("mouseover", (event) => {
    const row = event.target.closest(".node");
    if (!row || row === state.hovered) return;
    state.hovered = row;
    clearTimeout(state.timer);
    const show = () => showPrefix(row, lookup(Number(row.dataset.nodeId)), event);
    state.timer = setTimeout(show, HOVER_DELAY_MS);
  });
  container.addEventListener("mouseout", (event) => {
    const row = event.target.closest(".node");
    if (row && row.contains(event.relatedTarget)) return;
    state.hovered = null;
    clearTimeout(state.timer);
    $("tooltip").hidden = true;
  });
}

async function showPrefix(row, n, event) {
  const tip = $("tooltip");
  const head = el("div", "head");
  const body = el("pre");
  tip.replaceChildren(head, body);
  if (!n || n.state === "root") {
    head.textContent = n
      ? `${namespaceName(n)}: every prefix cached under it starts here`
      : "namespace root: every cached prefix starts here";
    place(tip, event);
    return;
  }
  head.textContent =
    `${fmtInt(n.tokens)} tokens after ${fmtInt(n.prefix_tokens)} · ${n.state}` +
    (n.locks ? ` by ${n.locks} running` : "") +
    ` · ${fmtInt(n.hits)} hits · ${fmtAge(n.last_access_s)}`;
  body.textContent =
    n.elided_tokens > 0
      ? `${n.text} … ${fmtInt(n.elided_tokens)} tokens … ${n.tail_text}`
      : n.text + n.tail_text;
  place(tip, event);
  const prefix = await fetchPrefix(n);
  if (state.hovered !== row) return;
  if (prefix.error) {
    head.textContent += ` · whole prefix unavailable: ${prefix.error}`;
    return;
  }
  head.textContent =
    `whole prefix, ${fmtInt(prefix.tokens)} tokens; this node's ` +
    `${fmtInt(n.tokens)} highlighted`;
  body.replaceChildren(prefix.above_text, el("mark", null, prefix.node_text));
  place(tip, event);
}

async function fetchPrefix(n) {
  const key = `${n.id}:${n.tokens}`;
  if (state.prefixes.has(key)) return state.prefixes.get(key);
  let answer;
  try {
    const response = await fetch(`cache_tree/prefix?node=${n.id}`);
    const body = await response.json();
    answer = response.ok ? body : { error: body.error ? body.error.message : response.status };
  } catch (error) {
    answer = { error: String(error) };
  }
  if (!answer.error) {
    if (state.prefixes.size > REMEMBERED) state.prefixes.clear();
    state.prefixes.set(key, answer);
  }
  return answer;
}

function place(tip, event) {
  tip.hidden = false;
  const pad = 14;
  const { clientX: x, clientY: y } = event;
  const left = Math.min(x + pad, window.innerWidth - tip.offsetWidth - pad);
  const below = y + pad + tip.offsetHeight <= window.innerHeight;
  tip.style.left = Math.max(pad, left) + "px";
  tip.style.top = Math.max(pad, below ? y + pad : y - tip.offsetHeight - pad) + "px";
}
