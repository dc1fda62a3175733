// Formatting of sizes, times and API objects for display.

import { h } from "./dom.js";

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v >= 100 || Number.isInteger(v) ? Math.round(v) : v.toFixed(1)} ${units[u]}`;
}

export function mib(n) {
  if (n === null || n === undefined) return "—";
  return n >= 1024 && n % 1024 === 0 ? `${n / 1024} GiB` : `${n} MiB`;
}

export function parseTime(t) {
  if (!t) return null;
  const d = new Date(t);
  return isNaN(d) ? null : d;
}

/** "12 s ago", "3 min ago", "2 h ago", "5 d ago"; a date past a week. */
export function ago(t) {
  const d = parseTime(t);
  if (!d) return "—";
  const s = Math.round((Date.now() - d.getTime()) / 1000);
  if (s < -5) return "in " + span(-s);
  if (s < 5) return "just now";
  if (s < 7 * 86400) return span(s) + " ago";
  return d.toLocaleDateString(undefined, { year: "numeric", month: "short", day: "numeric" });
}

function span(s) {
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h`;
  return `${Math.floor(s / 86400)} d`;
}

export function fullTime(t) {
  const d = parseTime(t);
  return d ? d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "medium" }) : "—";
}

/** A <time> element: relative text, the full date on hover. */
export function time(t) {
  if (!t) return h("span", { class: "muted" }, "—");
  return h("time", { datetime: t, title: fullTime(t), "data-ago": t }, ago(t));
}

/** Refreshes every relative time under `root` (called on a timer by pages). */
export function refreshTimes(root) {
  for (const el of root.querySelectorAll("time[data-ago]")) {
    const text = ago(el.getAttribute("data-ago"));
    if (el.textContent !== text) el.textContent = text;
  }
}

export function duration(ms) {
  if (ms === null || ms === undefined) return "—";
  if (ms < 1000) return `${ms} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${Math.round(s % 60)} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function between(a, b) {
  const x = parseTime(a);
  const y = parseTime(b);
  if (!x || !y) return null;
  return Math.max(0, y - x);
}

const STATE_TONE = {
  running: "ok",
  succeeded: "ok",
  exited: "ok",
  ready: "ok",
  creating: "busy",
  pausing: "busy",
  resuming: "busy",
  suspending: "busy",
  destroying: "busy",
  starting: "busy",
  pending: "busy",
  paused: "warn",
  suspended: "cold",
  destroyed: "off",
  cancelled: "off",
  lost: "bad",
  failed: "bad",
  killed: "bad",
  timed_out: "bad",
};

/** A colored state badge; its text is the state itself. */
export function badge(state, testid) {
  const tone = STATE_TONE[state] || "off";
  return h("span", { class: `badge tone-${tone}`, "data-testid": testid, "data-state": state, title: state }, state);
}

export function labelChips(labels) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return h("span", { class: "muted" }, "—");
  return h(
    "span",
    { class: "chips" },
    entries.map(([k, v]) => h("span", { class: "chip", title: `${k}=${v}` }, `${k}=${v}`)),
  );
}

export function resources(r) {
  if (!r) return "—";
  const parts = [];
  if (r.vcpus !== null && r.vcpus !== undefined) parts.push(`${r.vcpus} vCPU`);
  if (r.memory_mib !== null && r.memory_mib !== undefined) parts.push(mib(r.memory_mib));
  return parts.join(" · ") || "—";
}

/** The cost object as short labelled parts ("mem 64 MiB", "disk 24 KiB", "snapshot 1 GiB"). */
export function costParts(cost) {
  const c = cost || {};
  const parts = [];
  if (c.memory_bytes !== null && c.memory_bytes !== undefined) parts.push(["memory", bytes(c.memory_bytes)]);
  if (c.snapshot_bytes !== null && c.snapshot_bytes !== undefined) parts.push(["snapshot", bytes(c.snapshot_bytes)]);
  if (c.disk_bytes !== null && c.disk_bytes !== undefined) parts.push(["disk", bytes(c.disk_bytes)]);
  return parts;
}

export function cost(c) {
  const parts = costParts(c);
  if (!parts.length) return h("span", { class: "muted" }, "—");
  return h(
    "span",
    { class: "cost" },
    parts.map(([k, v]) => h("span", { class: "cost-part" }, h("span", { class: "cost-k" }, k), " ", v)),
  );
}

/** `drwxr-xr-x` from a file mode and type. */
export function modeString(mode, type) {
  if (mode === null || mode === undefined) return "";
  const t = type === "dir" ? "d" : type === "symlink" ? "l" : "-";
  const rwx = ["r", "w", "x"];
  let s = "";
  for (let i = 8; i >= 0; i--) s += mode & (1 << i) ? rwx[(8 - i) % 3] : "-";
  return t + s;
}

/** Removes terminal escape sequences (colors, cursor moves, titles) for plain display. */
export function stripAnsi(text) {
  return text
    .replace(/\x1b\][^\x07\x1b]*(\x07|\x1b\\)/g, "")
    .replace(/\x1b\[[0-?]*[ -/]*[@-~]/g, "")
    .replace(/\x1b[@-Z\\-_]/g, "")
    .replace(/\r\n/g, "\n")
    .replace(/\r/g, "");
}

export function plural(n, word, many = word + "s") {
  return `${n} ${n === 1 ? word : many}`;
}
