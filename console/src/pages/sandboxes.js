// #/sandboxes: every sandbox of the tenant, live. The list is `GET /v1/sandboxes`, then
// each `sandbox` event replaces the object with the same id (newer `version` wins), so
// state changes and new sandboxes show up without a reload.

import { h, replace, icon } from "../dom.js";
import { api, describe } from "../api.js";
import * as events from "../events.js";
import { badge, cost, labelChips, resources, time, refreshTimes } from "../format.js";
import { button, emptyState, errorState, field, fullRow, loading, modal, pageHeader, toast } from "../ui.js";
import { follow } from "../ops.js";
import { mergeSandbox } from "../model.js";

const STATES = ["creating", "running", "pausing", "paused", "resuming", "suspending", "suspended", "destroying", "destroyed", "failed"];
const COLS = 8;

// Filters survive navigating away and back (not a reload).
const filters = { label: "", state: "", template: "", showDestroyed: false };

/** `k=v,k2=v2` → [[k, v], …]; a bare `k` matches any value of that label. */
function parseLabelFilter(text) {
  return text
    .split(",")
    .map((p) => p.trim())
    .filter(Boolean)
    .map((p) => {
      const i = p.indexOf("=");
      return i < 0 ? [p, null] : [p.slice(0, i).trim(), p.slice(i + 1).trim()];
    });
}

function matches(sb, labelFilter) {
  if (!filters.showDestroyed && sb.state === "destroyed" && filters.state !== "destroyed") return false;
  if (filters.state && sb.state !== filters.state) return false;
  if (filters.template && sb.template !== filters.template) return false;
  for (const [k, v] of labelFilter) {
    const have = (sb.labels || {})[k];
    if (have === undefined) return false;
    if (v !== null && have !== v) return false;
  }
  return true;
}

export function renderSandboxes(ctx, view) {
  const sandboxes = new Map();
  const rows = new Map(); // id → { version, el }
  let loaded = false;
  let loadError = null;
  let templates = [];

  const tbody = h("tbody");
  const count = h("span", { class: "count" });
  const labelInput = h("input", {
    type: "search",
    placeholder: "label: key=value",
    value: filters.label,
    "data-testid": "filter-label",
    "aria-label": "Filter by label (key=value)",
    oninput: () => {
      filters.label = labelInput.value;
      render();
    },
  });
  const stateSelect = h(
    "select",
    {
      "data-testid": "filter-state",
      "aria-label": "Filter by state",
      onchange: () => {
        filters.state = stateSelect.value;
        render();
      },
    },
    h("option", { value: "" }, "All states"),
    STATES.map((s) => h("option", { value: s, selected: filters.state === s }, s)),
  );
  const templateSelect = h("select", {
    "data-testid": "filter-template",
    "aria-label": "Filter by template",
    onchange: () => {
      filters.template = templateSelect.value;
      render();
    },
  });
  const destroyedToggle = h("input", {
    type: "checkbox",
    checked: filters.showDestroyed,
    "data-testid": "filter-destroyed",
    onchange: () => {
      filters.showDestroyed = destroyedToggle.checked;
      render();
    },
  });
  const clearBtn = button("Clear", () => clearFilters(), { small: true, kind: "ghost", testid: "filter-clear" });

  function clearFilters() {
    filters.label = "";
    filters.state = "";
    filters.template = "";
    labelInput.value = "";
    stateSelect.value = "";
    templateSelect.value = "";
    render();
  }

  let optionsKey = null;
  function fillTemplateOptions() {
    const names = new Set(templates.map((t) => t.name));
    for (const sb of sandboxes.values()) names.add(sb.template);
    if (filters.template) names.add(filters.template);
    const sorted = [...names].sort();
    const key = sorted.join("\n");
    if (key === optionsKey) return;
    optionsKey = key;
    replace(
      templateSelect,
      h("option", { value: "" }, "All templates"),
      sorted.map((n) => h("option", { value: n, selected: filters.template === n }, n)),
    );
  }

  function row(sb) {
    const href = `#/sandboxes/${encodeURIComponent(sb.id)}`;
    return h(
      "tr",
      { "data-testid": "sandbox-row", "data-id": sb.id, class: sb.state === "destroyed" ? "row-dim" : null },
      h("td", null, h("a", { href, class: "mono id-link", "data-testid": "sandbox-link" }, sb.id)),
      h("td", null, badge(sb.state, "sandbox-state"), sb.failure_reason ? h("div", { class: "cell-note error-text", title: sb.failure_reason }, sb.failure_reason) : null),
      h("td", null, h("span", null, sb.template), sb.template_version ? h("div", { class: "cell-note mono" }, sb.template_version) : null),
      h("td", null, sb.runtime, sb.accelerator ? h("div", { class: "cell-note" }, sb.accelerator) : null),
      h("td", null, labelChips(sb.labels)),
      h("td", { class: "nowrap" }, resources(sb.resources)),
      h("td", { "data-testid": "sandbox-cost" }, cost(sb.cost)),
      h("td", { class: "nowrap" }, time(sb.created_at)),
    );
  }

  let scheduled = false;
  function render() {
    if (scheduled) return;
    scheduled = true;
    requestAnimationFrame(() => {
      scheduled = false;
      draw();
    });
  }

  function draw() {
    if (!loaded) {
      replace(tbody, fullRow(COLS, loadError ? errorState("Could not load sandboxes", loadError, () => load()) : loading("Loading sandboxes…")));
      count.textContent = "";
      return;
    }
    fillTemplateOptions();
    const lf = parseLabelFilter(filters.label);
    const all = [...sandboxes.values()].sort((a, b) => (a.created_at < b.created_at ? 1 : a.created_at > b.created_at ? -1 : a.id.localeCompare(b.id)));
    const shown = all.filter((sb) => matches(sb, lf));
    const live = all.filter((sb) => sb.state !== "destroyed").length;
    count.textContent = `${live} active${all.length > live ? ` · ${all.length - live} destroyed` : ""}`;
    const filtering = filters.label.trim() || filters.state || filters.template;
    clearBtn.hidden = !filtering;
    if (!shown.length) {
      if (!all.length || (!filtering && all.every((s) => s.state === "destroyed"))) {
        replace(
          tbody,
          fullRow(
            COLS,
            emptyState(
              "No sandboxes yet",
              all.length ? "Every sandbox of this tenant has been destroyed. Tick “Show destroyed” to see them." : "Create one here, with the CLI (space sandbox create) or through the API; it appears here as it boots.",
              button("New sandbox", () => openCreate(), { kind: "primary", icon: "plus" }),
            ),
          ),
        );
      } else {
        replace(tbody, fullRow(COLS, emptyState("No sandboxes match these filters", "Change or clear the filters to see more.", button("Clear filters", () => clearFilters(), { icon: "x" }))));
      }
      rows.clear();
      return;
    }
    const els = [];
    const keep = new Set();
    for (const sb of shown) {
      let r = rows.get(sb.id);
      const key = `${sb.version}|${sb.state}|${JSON.stringify(sb.cost || {})}`;
      if (!r || r.key !== key) {
        r = { key, el: row(sb) };
        rows.set(sb.id, r);
      }
      keep.add(sb.id);
      els.push(r.el);
    }
    for (const id of rows.keys()) if (!keep.has(id)) rows.delete(id);
    // Reorder/replace in place so that unchanged rows keep their nodes.
    const existing = [...tbody.children];
    if (existing.length !== els.length || existing.some((el, i) => el !== els[i])) replace(tbody, els);
  }

  function apply(sb) {
    const next = mergeSandbox(sandboxes.get(sb.id), sb);
    if (!next) return;
    sandboxes.set(sb.id, next);
    if (loaded) render();
  }

  // Events carry no cost: read the list again once a burst of events has settled.
  let refetch = null;
  function onEvent(sb) {
    apply(sb);
    clearTimeout(refetch);
    refetch = setTimeout(() => loaded && load(), 400);
  }
  ctx.cleanup(() => clearTimeout(refetch));

  async function load() {
    loadError = null;
    if (!loaded) render();
    try {
      const [list, tpl] = await Promise.all([api("/v1/sandboxes", { signal: ctx.signal }), api("/v1/templates", { signal: ctx.signal }).catch(() => ({ templates: [] }))]);
      templates = tpl.templates || [];
      for (const sb of list.sandboxes || []) apply(sb);
      loaded = true;
    } catch (e) {
      if (e.name === "AbortError") return;
      if (!loaded) loadError = e;
      else toast("Could not refresh the list: " + describe(e), "error");
    }
    render();
  }

  // Subscribe before the first load so that no change falls between the two; refetch
  // whenever the feed (re)connects, in case events were missed while it was down.
  ctx.cleanup(events.on("sandbox", onEvent));
  let wasLive = events.status().status === "live";
  ctx.cleanup(
    events.onStatus((s) => {
      const live = s.status === "live";
      if (live && !wasLive && loaded) load();
      wasLive = live;
    }),
  );
  const tick = setInterval(() => refreshTimes(tbody), 15000);
  ctx.cleanup(() => clearInterval(tick));
  // Costs change without events (memory is measured as it goes): refresh now and then.
  const costs = setInterval(() => loaded && !document.hidden && load(), 20000);
  ctx.cleanup(() => clearInterval(costs));

  async function openCreate() {
    openCreateDialog(templates, ctx);
  }

  replace(
    view,
    pageHeader("Sandboxes", "Isolated environments of this tenant, updated live.", count, button("New sandbox", () => openCreate(), { kind: "primary", icon: "plus", testid: "sandbox-new" })),
    h(
      "div",
      { class: "toolbar" },
      h("div", { class: "search" }, icon("search", 15), labelInput),
      stateSelect,
      templateSelect,
      h("label", { class: "check" }, destroyedToggle, h("span", null, "Show destroyed")),
      clearBtn,
    ),
    h(
      "div",
      { class: "card table-card" },
      h(
        "table",
        { class: "table", "data-testid": "sandbox-table" },
        h("thead", null, h("tr", null, ["ID", "State", "Template", "Runtime", "Labels", "Resources", "Cost", "Created"].map((c) => h("th", null, c)))),
        tbody,
      ),
    ),
  );
  fillTemplateOptions();
  draw();
  load();
}

/** The "New sandbox" dialog: template, labels, resources, TTL → POST /v1/sandboxes. */
export async function openCreateDialog(knownTemplates, ctx) {
  const templateSel = h("select", { name: "template", required: true, "data-testid": "create-template" });
  const fill = (list) =>
    replace(
      templateSel,
      list.length ? list.map((t) => h("option", { value: t.name, disabled: t.ready === false && !t.builtin }, t.name + (t.version ? ` (${t.version})` : ""))) : h("option", { value: "" }, "Loading templates…"),
    );
  fill(knownTemplates || []);
  const runtimeSel = h("select", { name: "runtime", "data-testid": "create-runtime" }, h("option", { value: "" }, "Server default"));
  const labels = h("input", { type: "text", placeholder: "team=a, purpose=demo", "data-testid": "create-labels" });
  const vcpus = h("input", { type: "number", min: "1", placeholder: "default", "data-testid": "create-vcpus" });
  const memory = h("input", { type: "number", min: "64", step: "64", placeholder: "default", "data-testid": "create-memory" });
  const ttl = h("input", { type: "number", min: "0", placeholder: "none", "data-testid": "create-ttl" });
  const error = h("p", { class: "form-error", role: "alert", hidden: true });
  const submit = h("button", { type: "submit", class: "btn btn-primary", "data-testid": "create-submit" }, icon("plus"), h("span", null, "Create sandbox"));

  const form = h(
    "form",
    {
      class: "form",
      onsubmit: async (e) => {
        e.preventDefault();
        error.hidden = true;
        const body = { template: templateSel.value };
        if (!body.template) return;
        if (runtimeSel.value) body.runtime = runtimeSel.value;
        const lbl = {};
        for (const part of labels.value.split(",").map((s) => s.trim()).filter(Boolean)) {
          const i = part.indexOf("=");
          if (i <= 0) {
            error.textContent = `Labels are key=value pairs separated by commas: "${part}" has no "=".`;
            error.hidden = false;
            return;
          }
          lbl[part.slice(0, i).trim()] = part.slice(i + 1).trim();
        }
        if (Object.keys(lbl).length) body.labels = lbl;
        const res = {};
        if (vcpus.value) res.vcpus = Number(vcpus.value);
        if (memory.value) res.memory_mib = Number(memory.value);
        if (Object.keys(res).length) body.resources = res;
        if (ttl.value) body.ttl_seconds = Number(ttl.value);
        submit.disabled = true;
        try {
          const op = await api("/v1/sandboxes", { method: "POST", json: body });
          dlg.close();
          const note = toast(`Creating ${op.sandbox_id || "a sandbox"}…`, "info", 0);
          follow(op, () => {}, ctx?.signal).then((end) => {
            note.remove();
            if (end.status === "succeeded") toast(`${end.sandbox_id} is running`, "ok");
            else if (end.status === "failed") toast(`Creating ${end.sandbox_id} failed: ${end.error ? end.error.message : "unknown error"}`, "error");
          });
        } catch (err) {
          error.textContent = describe(err);
          error.hidden = false;
          submit.disabled = false;
        }
      },
    },
    h("div", { class: "form-grid" }, field("Template", templateSel), field("Runtime", runtimeSel)),
    field("Labels", labels, "Comma-separated key=value pairs, usable as filters."),
    h("div", { class: "form-grid three" }, field("vCPUs", vcpus), field("Memory (MiB)", memory), field("TTL (seconds)", ttl)),
    error,
    h("div", { class: "form-actions" }, button("Cancel", () => dlg.close(), { kind: "ghost" }), submit),
  );
  const dlg = modal("New sandbox", form);
  ctx?.cleanup(() => dlg.el.isConnected && dlg.close());
  try {
    const [tpl, rt] = await Promise.all([api("/v1/templates"), api("/v1/runtimes").catch(() => ({ runtimes: [] }))]);
    const prev = templateSel.value;
    fill(tpl.templates || []);
    if (prev) templateSel.value = prev;
    for (const r of rt.runtimes || []) {
      runtimeSel.appendChild(h("option", { value: r.name, disabled: !r.available, title: r.reason || "" }, `${r.name}${r.default ? " (default)" : ""}${r.available ? "" : " — unavailable"}`));
    }
  } catch (err) {
    error.textContent = "Could not load templates: " + describe(err);
    error.hidden = false;
  }
}
