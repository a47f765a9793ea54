// Small helpers every part of the page uses: DOM building and number formatting. Text from the
// model or the callers is only ever set as textContent.

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

export function setText(id, text) {
  const node = $(id);
  if (node.textContent !== text) node.textContent = text;
}

export const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
export const fmtPct = (x) => (x == null ? "–" : (100 * x).toFixed(1) + "%");

export function fmtMs(seconds) {
  if (seconds == null) return "–";
  const ms = 1000 * seconds;
  return (ms < 10 ? ms.toFixed(2) : ms < 100 ? ms.toFixed(1) : ms.toFixed(0)) + " ms";
}

export function fmtAge(seconds) {
  if (seconds == null) return "long ago";
  if (seconds < 1) return "now";
  if (seconds < 60) return seconds.toFixed(0) + " s ago";
  if (seconds < 3600) return (seconds / 60).toFixed(0) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

// A request's name: the caller's rid, or "#n" for the server's own id "<instance>-n".
// Requests share cache only within one cache salt: each salt's prefixes hang off a root of
// their own, labelled by the salt's fingerprint (the salt itself never reaches the page).
export const namespaceName = (n) => (n.namespace ? `cache ${n.namespace}` : "cache without salt");

export const requestName = (r) => (r.id === r.rid ? "#" + r.rid.split("-").pop() : r.id);

// One line of decoded text with its line breaks and tabs made visible.
export const oneLine = (text) => text.replace(/\r?\n/g, "↵").replace(/\t/g, "⇥");
