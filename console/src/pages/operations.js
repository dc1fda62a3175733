// #/operations: the tenant's operations, newest first (`GET /v1/operations`), kept
// current by `operation` events.

import { h, replace } from "../dom.js";
import { api, describe } from "../api.js";
import * as events from "../events.js";
import { badge, between, duration, time, refreshTimes } from "../format.js";
import { button, emptyState, errorState, fullRow, loading, pageHeader, toast } from "../ui.js";
import { ENDED } from "../ops.js";

const COLS = 7;
const KINDS = ["create", "pause", "resume", "suspend", "destroy", "build"];
const STATUSES = ["pending", "running", "succeeded", "failed", "cancelled"];
const filters = { kind: "", status: "" };

export function renderOperations(ctx, view) {
  const ops = new Map();
  let loaded = false;
  let error = null;
  const tbody = h("tbody");
  const count = h("span", { class: "count" });

  const kindSel = h(
    "select",
    { "aria-label": "Kind", "data-testid": "filter-kind", onchange: () => ((filters.kind = kindSel.value), draw()) },
    h("option", { value: "" }, "All kinds"),
    KINDS.map((k) => h("option", { value: k, selected: filters.kind === k }, k)),
  );
  const statusSel = h(
    "select",
    { "aria-label": "Status", "data-testid": "filter-status", onchange: () => ((filters.status = statusSel.value), draw()) },
    h("option", { value: "" }, "All statuses"),
    STATUSES.map((s) => h("option", { value: s, selected: filters.status === s }, s)),
  );

  function apply(o) {
    const have = ops.get(o.id);
    if (have && (have.version ?? 0) > (o.version ?? 0)) return;
    ops.set(o.id, o);
    if (loaded) schedule();
  }

  let pending = false;
  function schedule() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      draw();
    });
  }

  async function cancel(o) {
    try {
      apply(await api(`/v1/operations/${encodeURIComponent(o.id)}/cancel`, { method: "POST" }));
    } catch (e) {
      toast(`Could not cancel ${o.id}: ${describe(e)}`, "error");
    }
  }

  function target(o) {
    if (o.sandbox_id) return h("a", { class: "mono", href: `#/sandboxes/${encodeURIComponent(o.sandbox_id)}` }, o.sandbox_id);
    if (o.template) return h("span", null, h("span", { class: "muted" }, "template "), h("a", { href: "#/templates" }, o.template));
    return h("span", { class: "muted" }, "—");
  }

  function draw() {
    if (!loaded) {
      replace(tbody, fullRow(COLS, error ? errorState("Could not load operations", error, () => load()) : loading("Loading operations…")));
      return;
    }
    const all = [...ops.values()].sort((a, b) => (a.created_at < b.created_at ? 1 : a.created_at > b.created_at ? -1 : 0));
    const shown = all.filter((o) => (!filters.kind || o.kind === filters.kind) && (!filters.status || o.status === filters.status));
    const active = all.filter((o) => !ENDED.has(o.status)).length;
    count.textContent = `${all.length} shown${active ? ` · ${active} in progress` : ""}`;
    if (!shown.length) {
      replace(
        tbody,
        fullRow(COLS, all.length ? emptyState("No operations match", "Change the filters to see more.") : emptyState("No operations yet", "Creating, pausing, resuming, suspending or destroying a sandbox, or building a template, records an operation here.")),
      );
      return;
    }
    replace(
      tbody,
      shown.map((o) => {
        const took = between(o.created_at, o.updated_at);
        return h(
          "tr",
          { "data-testid": "operation-row", "data-id": o.id, "data-kind": o.kind, "data-status": o.status },
          h("td", null, h("strong", null, o.kind), h("div", { class: "cell-note mono" }, o.id)),
          h("td", null, target(o)),
          h("td", null, badge(o.status, "operation-state")),
          h("td", { class: "progress-cell" }, o.progress ? h("span", { title: o.progress }, o.progress) : h("span", { class: "muted" }, "—")),
          h("td", { class: "error-cell" }, o.error ? h("span", { class: "error-text", title: o.error.message }, h("span", { class: "mono" }, o.error.code), ": ", o.error.message) : h("span", { class: "muted" }, "—")),
          h("td", { class: "nowrap" }, time(o.created_at), ENDED.has(o.status) && took !== null ? h("div", { class: "cell-note" }, `took ${duration(took)}`) : null),
          h("td", { class: "row-actions" }, o.status === "pending" ? button("Cancel", () => cancel(o), { small: true, kind: "ghost-danger" }) : null),
        );
      }),
    );
  }

  async function load() {
    try {
      const r = await api("/v1/operations", { query: { limit: 200 }, signal: ctx.signal });
      for (const o of r.operations || []) apply(o);
      loaded = true;
      error = null;
    } catch (e) {
      if (e.name === "AbortError") return;
      if (!loaded) error = e;
    }
    draw();
  }

  ctx.cleanup(events.on("operation", apply));
  let wasLive = events.status().status === "live";
  ctx.cleanup(
    events.onStatus((s) => {
      if (s.status === "live" && !wasLive && loaded) load();
      wasLive = s.status === "live";
    }),
  );
  const tick = setInterval(() => refreshTimes(tbody), 15000);
  ctx.cleanup(() => clearInterval(tick));

  replace(
    view,
    pageHeader("Operations", "Every asynchronous request of this tenant, newest first, updated live.", count),
    h("div", { class: "toolbar" }, kindSel, statusSel),
    h(
      "div",
      { class: "card table-card" },
      h("table", { class: "table" }, h("thead", null, h("tr", null, ["Kind", "Target", "Status", "Progress", "Error", "Created", ""].map((c) => h("th", null, c)))), tbody),
    ),
  );
  draw();
  load();
}
