// #/sandboxes/<id>[/commands|terminal|files]: one sandbox, live, with its lifecycle
// actions (each answers 202 + an operation, followed here to its end) and three tabs.

import { h, replace, icon } from "../dom.js";
import { api, ApiError, describe } from "../api.js";
import * as events from "../events.js";
import { badge, cost, labelChips, resources, time, refreshTimes, mib, duration, between } from "../format.js";
import { button, errorState, loading } from "../ui.js";
import { follow, ENDED, KIND_VERB } from "../ops.js";
import { mountCommands } from "./commands.js";
import { mountTerminal } from "./terminal.js";
import { mountFiles } from "./files.js";
import { mergeSandbox } from "../model.js";

const TABS = [
  ["commands", "Commands", "list"],
  ["terminal", "Terminal", "terminal"],
  ["files", "Files", "folder"],
];

const ACTIONS = [
  { id: "pause", label: "Pause", icon: "pause", states: ["running"], title: "Freeze it in memory; resumes in milliseconds" },
  { id: "resume", label: "Resume", icon: "play", states: ["paused", "suspended"], title: "Continue where it left off" },
  { id: "suspend", label: "Suspend", icon: "moon", states: ["running", "paused"], title: "Snapshot memory and files to disk and free its memory" },
  {
    id: "destroy",
    label: "Destroy",
    icon: "trash",
    kind: "danger",
    states: ["creating", "running", "pausing", "paused", "resuming", "suspending", "suspended", "failed"],
    title: "Delete it, its processes, files and snapshot",
  },
];

export function renderSandbox(ctx, view, id, initialTab) {
  let sb = null;
  const sbListeners = new Set();
  let op = null; // the operation shown in the status line
  let opError = null; // a request that failed before any operation existed
  let actionBusy = false;

  const head = h("div", { class: "page-header sandbox-head" });
  const opLine = h("div", { class: "op-status", "data-testid": "operation-status", "aria-live": "polite", hidden: true });
  const summary = h("div", { class: "summary" });
  const tabBar = h("div", { class: "tabs", role: "tablist" });
  const panels = h("div", { class: "tab-panels" });
  const body = h("div", { class: "sandbox-body" }, summary, tabBar, panels);
  replace(view, h("div", { class: "crumbs" }, h("a", { href: "#/sandboxes" }, "Sandboxes"), h("span", { class: "sep" }, "/"), h("span", { class: "mono" }, id)), head, opLine, loading("Loading the sandbox…"));

  const actionButtons = {};
  for (const a of ACTIONS) {
    actionButtons[a.id] = button(a.label, () => act(a), { icon: a.icon, kind: a.kind, testid: `action-${a.id}`, title: a.title });
  }

  function drawHead() {
    replace(
      head,
      h(
        "div",
        { class: "page-title" },
        h("h1", { class: "mono sandbox-id" }, id, sb ? badge(sb.state, "sandbox-state") : null),
        sb
          ? h(
              "p",
              { class: "subtitle" },
              `${sb.template} · ${sb.runtime}${sb.accelerator ? ` (${sb.accelerator})` : ""} · created `,
              time(sb.created_at),
            )
          : null,
      ),
      h("div", { class: "page-actions" }, ACTIONS.map((a) => actionButtons[a.id])),
    );
    updateButtons();
  }

  function opActive() {
    return op && !ENDED.has(op.status);
  }

  function updateButtons() {
    for (const a of ACTIONS) {
      const allowed = sb && a.states.includes(sb.state);
      const blocked = actionBusy || (opActive() && a.id !== "destroy") || (a.id === "destroy" && opActive() && op.kind === "destroy");
      actionButtons[a.id].disabled = !allowed || blocked;
    }
  }

  function drawOp() {
    if (!op && !opError) {
      opLine.hidden = true;
      return;
    }
    opLine.hidden = false;
    if (opError && (!op || opError.at > op.at)) {
      opLine.dataset.status = "failed";
      replace(opLine, icon("alert", 16), h("span", { class: "op-text" }, h("strong", null, `${opError.verb} refused: `), opError.message), dismiss());
      return;
    }
    const verb = KIND_VERB[op.kind] || op.kind;
    opLine.dataset.status = op.status;
    const took = between(op.created_at, op.updated_at);
    let text;
    if (op.status === "succeeded") text = [h("strong", null, `${verb} succeeded`), took !== null ? ` in ${duration(took)}` : "", op.progress ? ` · ${op.progress}` : ""];
    else if (op.status === "failed")
      text = [h("strong", null, `${verb} failed`), op.error ? [": ", h("span", { class: "mono" }, op.error.code), " — ", op.error.message] : ""];
    else if (op.status === "cancelled") text = [h("strong", null, `${verb} cancelled`)];
    else text = [h("strong", null, `${verb} ${op.status === "pending" ? "queued" : "in progress"}`), op.progress ? ` · ${op.progress}` : "…"];
    replace(
      opLine,
      ENDED.has(op.status) ? icon(op.status === "succeeded" ? "check" : "alert", 16) : h("span", { class: "spinner sm" }),
      h("span", { class: "op-text" }, text),
      h("a", { class: "op-link mono", href: "#/operations", title: "All operations" }, op.id),
      ENDED.has(op.status) ? dismiss() : null,
    );
  }

  function dismiss() {
    return h(
      "button",
      {
        type: "button",
        class: "icon-btn",
        "aria-label": "Dismiss",
        onclick: () => {
          op = null;
          opError = null;
          drawOp();
          updateButtons();
        },
      },
      icon("x", 14),
    );
  }

  function showOp(o) {
    if (op && o.id !== op.id && (o.created_at || "") < (op.created_at || "")) return;
    if (op && o.id === op.id && (o.version ?? 0) < (op.version ?? 0)) return;
    op = { ...o, at: Date.now() };
    drawOp();
    updateButtons();
  }

  async function act(a) {
    if (!sb) return;
    if (a.id === "destroy" && !window.confirm(`Destroy ${id}?\n\nIts processes, files and any snapshot are deleted. This cannot be undone.`)) return;
    actionBusy = true;
    updateButtons();
    try {
      const o = await api(`/v1/sandboxes/${encodeURIComponent(id)}${a.id === "destroy" ? "" : "/" + a.id}`, { method: a.id === "destroy" ? "DELETE" : "POST" });
      opError = null;
      actionBusy = false;
      follow(o, showOp, ctx.signal);
    } catch (e) {
      actionBusy = false;
      if (e.name === "AbortError") return;
      opError = { verb: a.label, message: describe(e), at: Date.now() };
      drawOp();
      updateButtons();
    }
  }

  function drawSummary() {
    const r = sb.resources || {};
    const items = [
      ["Template", h("span", null, sb.template, " ", h("span", { class: "muted mono" }, sb.template_version || ""))],
      ["Runtime", `${sb.runtime}${sb.accelerator ? ` · ${sb.accelerator}` : ""}`],
      ["Resources", h("span", { title: r.pids ? `at most ${r.pids} processes` : null }, resources(r), r.disk_mib ? ` · disk ${mib(r.disk_mib)}` : "")],
      ["Cost", h("span", { "data-testid": "sandbox-cost" }, cost(sb.cost))],
      ["Network", sb.network ? sb.network.mode + (sb.network.allow && sb.network.allow.length ? ` (${sb.network.allow.join(", ")})` : "") : "—"],
      ["Labels", labelChips(sb.labels)],
      sb.destroyed_at ? ["Destroyed", time(sb.destroyed_at)] : ["Expires", sb.expires_at ? time(sb.expires_at) : h("span", { class: "muted" }, "no TTL")],
      ["Last active", time(sb.last_active_at)],
    ];
    if (sb.idle_timeout_seconds) items.push(["Idle timeout", `${sb.idle_timeout_seconds} s → ${sb.on_idle || "suspend"}`]);
    if (sb.secret_names && sb.secret_names.length) items.push(["Secrets", sb.secret_names.join(", ")]);
    replace(
      summary,
      sb.failure_reason ? h("div", { class: "banner banner-error", role: "alert" }, icon("alert", 16), h("span", null, h("strong", null, "Failed: "), sb.failure_reason)) : null,
      h(
        "dl",
        { class: "facts" },
        items.map(([k, v]) => h("div", { class: "fact" }, h("dt", null, k), h("dd", null, v))),
      ),
    );
  }

  // Tabs: built on first show, then kept (a terminal survives switching tabs).
  const mounted = {};
  let activeTab = null;
  const tabButtons = {};
  for (const [tid, label, ic] of TABS) {
    tabButtons[tid] = h(
      "a",
      { href: `#/sandboxes/${encodeURIComponent(id)}/${tid}`, role: "tab", class: "tab", "data-testid": `tab-${tid}`, "aria-selected": "false" },
      icon(ic, 15),
      h("span", null, label),
    );
  }
  replace(tabBar, TABS.map(([tid]) => tabButtons[tid]));

  const sandboxApi = {
    id,
    get: () => sb,
    onChange(fn) {
      sbListeners.add(fn);
      return () => sbListeners.delete(fn);
    },
    resume: () => act(ACTIONS[1]),
  };

  function showTab(tid) {
    if (!TABS.some(([t]) => t === tid)) tid = "commands";
    if (activeTab === tid) return;
    activeTab = tid;
    for (const [t] of TABS) {
      tabButtons[t].classList.toggle("active", t === tid);
      tabButtons[t].setAttribute("aria-selected", String(t === tid));
    }
    if (!mounted[tid]) {
      const panel = h("div", { class: "tab-panel", role: "tabpanel", "data-tab": tid });
      panels.appendChild(panel);
      const mount = { commands: mountCommands, terminal: mountTerminal, files: mountFiles }[tid];
      mounted[tid] = { panel, api: mount(ctx, panel, sandboxApi) };
    }
    for (const [t, m] of Object.entries(mounted)) {
      m.panel.hidden = t !== tid;
      if (t === tid) m.api?.show?.();
      else m.api?.hide?.();
    }
  }

  ctx.onRoute = (parts) => showTab(parts[2] || "commands");

  function applySandbox(o) {
    if (o.id !== id) return;
    const next = mergeSandbox(sb, o);
    if (!next) return;
    const first = !sb;
    sb = next;
    if (first) {
      replace(view, view.firstChild, head, opLine, body);
      showTab(initialTab || "commands");
    }
    drawHead();
    drawSummary();
    for (const fn of sbListeners) fn(sb);
  }

  // Events carry no cost: read the sandbox again once a burst of events has settled,
  // and now and then (memory is measured as it runs).
  let refetch = null;
  ctx.cleanup(
    events.on("sandbox", (o) => {
      if (o.id !== id) return;
      applySandbox(o);
      clearTimeout(refetch);
      refetch = setTimeout(() => sb && load(true), 250);
    }),
  );
  const costs = setInterval(() => sb && !document.hidden && load(true), 15000);
  ctx.cleanup(() => {
    clearTimeout(refetch);
    clearInterval(costs);
  });
  ctx.cleanup(
    events.on("operation", (o) => {
      if (o.sandbox_id !== id) return;
      if (!op || o.id === op.id || !ENDED.has(o.status)) showOp(o);
    }),
  );
  let wasLive = events.status().status === "live";
  ctx.cleanup(
    events.onStatus((s) => {
      const live = s.status === "live";
      if (live && !wasLive && sb) load();
      wasLive = live;
    }),
  );
  const tick = setInterval(() => refreshTimes(view), 15000);
  ctx.cleanup(() => clearInterval(tick));

  async function load(quiet) {
    try {
      const o = await api(`/v1/sandboxes/${encodeURIComponent(id)}`, { signal: ctx.signal });
      applySandbox(o);
      if (quiet) return;
    } catch (e) {
      if (e.name === "AbortError") return;
      if (sb) return;
      const notFound = e instanceof ApiError && e.status === 404;
      replace(
        view,
        view.firstChild,
        errorState(
          notFound ? "No such sandbox" : "Could not load the sandbox",
          notFound ? `There is no sandbox ${id} for this key: it never existed, was purged after its retention, or belongs to another tenant.` : e,
          notFound ? null : () => {
            replace(view, view.firstChild, loading("Loading the sandbox…"));
            load();
          },
        ),
      );
      if (notFound) view.lastChild.appendChild(h("div", { class: "state-actions" }, h("a", { class: "btn", href: "#/sandboxes" }, "All sandboxes")));
      return;
    }
    // An operation already under way (started elsewhere) shows in the status line.
    try {
      const ops = await api("/v1/operations", { query: { sandbox_id: id, limit: 1 }, signal: ctx.signal });
      const last = ops.operations && ops.operations[0];
      if (last && !ENDED.has(last.status) && !op) follow(last, showOp, ctx.signal);
    } catch {
      /* the status line is optional */
    }
  }
  drawHead();
  load();
}
