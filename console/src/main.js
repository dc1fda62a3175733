// The space web console: a single page over the /v1 API, with hash routing.
//   #/sandboxes, #/sandboxes/<id>[/<tab>], #/templates, #/operations, #/pools

import "@xterm/xterm/css/xterm.css";
import "./style.css";

import { h, icon, replace } from "./dom.js";
import { api, ApiError, clearKey, getKey, onUnauthorized, setKey } from "./api.js";
import * as events from "./events.js";
import { errorState } from "./ui.js";
import { session } from "./session.js";
import { renderSandboxes } from "./pages/sandboxes.js";
import { renderSandbox } from "./pages/sandbox.js";
import { renderTemplates } from "./pages/templates.js";
import { renderOperations } from "./pages/operations.js";
import { renderPools } from "./pages/pools.js";

const app = document.getElementById("app");
let current = null; // { abort: AbortController, cleanups: [] }
let shell = null; // the signed-in layout: { view, nav, tenant }

const NAV = [
  ["sandboxes", "Sandboxes", "box"],
  ["templates", "Templates", "layers"],
  ["operations", "Operations", "list"],
  ["pools", "Pools", "refresh"],
];

function parseRoute() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [path] = hash.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return parts;
}

function teardown() {
  if (!current) return;
  current.abort.abort();
  for (const fn of current.cleanups.reverse()) {
    try {
      fn();
    } catch (e) {
      console.error(e);
    }
  }
  current = null;
}

function route() {
  if (!getKey()) {
    renderLogin();
    return;
  }
  if (!shell) renderShell();
  const parts = parseRoute();
  if (!parts.length) {
    location.replace("#/sandboxes");
    return;
  }
  const section = parts[0];
  // Staying on the same sandbox page (only the tab changed) keeps the page alive.
  if (current && current.key === parts.slice(0, 2).join("/") && section === "sandboxes" && parts[1]) {
    current.onRoute?.(parts);
    return;
  }
  teardown();
  const abort = new AbortController();
  const ctx = {
    key: parts.slice(0, 2).join("/"),
    abort,
    signal: abort.signal,
    cleanups: [],
    cleanup(fn) {
      this.cleanups.push(fn);
    },
    onRoute: null,
  };
  current = ctx;
  for (const a of shell.nav.querySelectorAll("a")) a.classList.toggle("active", a.dataset.section === section);
  const view = shell.view;
  replace(view);
  view.scrollTop = 0;
  window.scrollTo(0, 0);
  if (section === "sandboxes" && parts[1]) {
    document.title = `${parts[1]} · space console`;
    renderSandbox(ctx, view, parts[1], parts[2]);
  } else if (section === "sandboxes") {
    document.title = "Sandboxes · space console";
    renderSandboxes(ctx, view);
  } else if (section === "templates") {
    document.title = "Templates · space console";
    renderTemplates(ctx, view);
  } else if (section === "operations") {
    document.title = "Operations · space console";
    renderOperations(ctx, view);
  } else if (section === "pools") {
    document.title = "Pools · space console";
    renderPools(ctx, view);
  } else {
    document.title = "Not found · space console";
    replace(view, errorState("There is no such page", `Nothing lives at #/${parts.join("/")}.`), h("p", { class: "center" }, h("a", { href: "#/sandboxes" }, "Go to sandboxes")));
  }
}

/** Enough of the key to tell keys apart, not enough to matter if the screen is seen: an
 * API key's prefix and 4 of its 64 hex digits; nothing of any other token. */
function maskKey(key) {
  if (/^spk_[0-9a-f]{8,}$/.test(key)) return key.slice(0, 8) + "…";
  return "token ••••";
}

function renderShell() {
  teardown();
  const nav = h(
    "nav",
    { class: "nav", "aria-label": "Sections" },
    NAV.map(([id, label, ic]) => h("a", { href: `#/${id}`, "data-section": id, "data-testid": `nav-${id}` }, icon(ic, 16), h("span", null, label))),
  );
  const live = h("span", { class: "live", "data-testid": "live-status", title: "Live updates from /v1/events" }, h("span", { class: "dot" }), h("span", { class: "live-text" }, "Offline"));
  const tenant = h("span", { class: "tenant", title: "The tenant this key belongs to" });
  const who = h(
    "div",
    { class: "session" },
    live,
    h("span", { class: "key-status", title: "Signed in with this key (kept for this browser tab only)" }, icon("lock", 14), tenant, h("code", { class: "key-mask" }, maskKey(getKey() || ""))),
    h("button", { type: "button", class: "btn btn-ghost-dark btn-sm", "data-testid": "logout", onclick: () => logout() }, icon("logout", 14), h("span", null, "Log out")),
  );
  const view = h("main", { class: "view", id: "view" });
  replace(
    app,
    h("header", { class: "topbar" }, h("a", { class: "brand", href: "#/sandboxes" }, icon("logo", 22), h("span", { class: "brand-name" }, "space"), h("span", { class: "brand-sub" }, "console")), nav, who),
    view,
  );
  const offStatus = events.onStatus((s) => {
    const text = { idle: "Offline", connecting: "Connecting…", live: "Live", reconnecting: "Reconnecting…" }[s.status] || s.status;
    live.dataset.status = s.status;
    live.querySelector(".live-text").textContent = text;
    live.title = s.status === "live" ? "Live updates from /v1/events are flowing" : `Live updates: ${text}${s.detail ? " — " + s.detail : ""}`;
  });
  const offTenant = session.onChange((me) => {
    tenant.textContent = me ? (me.operator ? `operator · tenant ${me.tenant}` : `tenant ${me.tenant}`) : "";
    tenant.hidden = !me;
  });
  shell = { view, nav, offStatus, offTenant };
  events.start();
  session.discover();
}

function logout(message) {
  teardown();
  events.stop();
  clearKey();
  session.reset();
  if (shell) {
    shell.offStatus();
    shell.offTenant();
  }
  shell = null;
  renderLogin(message);
}

onUnauthorized(() => {
  if (!getKey()) return;
  logout("The server no longer accepts this key (missing, wrong or revoked). Sign in again.");
});

function renderLogin(message) {
  teardown();
  shell = null;
  document.title = "Sign in · space console";
  const input = h("input", {
    type: "password",
    id: "login-key",
    name: "key",
    autocomplete: "current-password",
    spellcheck: "false",
    placeholder: "spk_…",
    required: true,
    "data-testid": "login-key",
  });
  const error = h("p", { class: "login-error", "data-testid": "login-error", role: "alert", hidden: !message }, message || "");
  const submit = h("button", { type: "submit", class: "btn btn-primary btn-block", "data-testid": "login-submit" }, h("span", null, "Sign in"));
  const form = h(
    "form",
    {
      class: "login-card",
      novalidate: true,
      onsubmit: async (e) => {
        e.preventDefault();
        const key = input.value.trim();
        if (!key) {
          showError("Enter an API key or the server's token.");
          return;
        }
        submit.disabled = true;
        submit.querySelector("span").textContent = "Checking…";
        error.hidden = true;
        try {
          const me = await api("/v1/whoami", { key });
          setKey(key);
          session.seed(me);
          route();
        } catch (err) {
          if (err instanceof ApiError && err.status === 401) showError("That key was not accepted (missing, wrong or revoked).");
          else if (err instanceof ApiError && err.status === 0) showError("Could not reach the server. Check that `space serve` is running, then try again.");
          else showError(`The server answered with an error: ${err.message}`);
          submit.disabled = false;
          submit.querySelector("span").textContent = "Sign in";
          input.focus();
          input.select();
        }
      },
    },
    h("div", { class: "login-brand" }, icon("logo", 30), h("span", { class: "brand-name" }, "space"), h("span", { class: "brand-sub" }, "console")),
    h("h1", null, "Sign in"),
    h("p", { class: "muted" }, "Use an API key (", h("code", null, "space keys create"), ") or, in dev mode, the dev token."),
    h("label", { class: "field", for: "login-key" }, h("span", { class: "field-label" }, "API key"), input),
    error,
    submit,
    h("p", { class: "login-note" }, icon("lock", 13), " The key is kept in this tab's session storage only and sent as a bearer token; closing the tab forgets it."),
  );
  function showError(text) {
    error.textContent = text;
    error.hidden = false;
  }
  replace(app, h("div", { class: "login-page" }, form));
  input.focus();
}

window.addEventListener("hashchange", route);
route();
