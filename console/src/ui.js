// Shared pieces of the layout: page headers, empty/loading/error states, toasts.

import { h, icon } from "./dom.js";
import { describe } from "./api.js";

export function pageHeader(title, subtitle, ...actions) {
  return h(
    "div",
    { class: "page-header" },
    h("div", { class: "page-title" }, h("h1", null, title), subtitle ? h("p", { class: "subtitle" }, subtitle) : null),
    h("div", { class: "page-actions" }, actions),
  );
}

export function emptyState(title, text, ...actions) {
  return h(
    "div",
    { class: "state-box empty", "data-testid": "empty-state" },
    h("div", { class: "state-icon" }, icon("box", 28)),
    h("h3", null, title),
    text ? h("p", null, text) : null,
    actions.length ? h("div", { class: "state-actions" }, actions) : null,
  );
}

export function errorState(title, err, retry) {
  return h(
    "div",
    { class: "state-box error", "data-testid": "error-state", role: "alert" },
    h("div", { class: "state-icon" }, icon("alert", 28)),
    h("h3", null, title),
    h("p", { class: "error-text" }, typeof err === "string" ? err : describe(err)),
    retry ? h("div", { class: "state-actions" }, button("Try again", retry, { icon: "refresh" })) : null,
  );
}

/** A neutral explanation (not an error): why something cannot be shown right now. */
export function noticeState(iconName, title, text, ...actions) {
  return h(
    "div",
    { class: "state-box notice", "data-testid": "notice-state" },
    h("div", { class: "state-icon" }, icon(iconName, 28)),
    h("h3", null, title),
    text ? h("p", null, text) : null,
    actions.length ? h("div", { class: "state-actions" }, actions) : null,
  );
}

export function loading(text = "Loading…") {
  return h("div", { class: "state-box loading", "data-testid": "loading-state", "aria-busy": "true" }, h("span", { class: "spinner" }), h("p", null, text));
}

/** A table row spanning every column, for empty/loading/error states inside tables. */
export function fullRow(cols, content) {
  return h("tr", { class: "state-row" }, h("td", { colspan: String(cols) }, content));
}

export function button(label, onclick, opts = {}) {
  return h(
    "button",
    {
      type: opts.type || "button",
      class: ["btn", opts.kind ? "btn-" + opts.kind : null, opts.small ? "btn-sm" : null, opts.class],
      onclick,
      disabled: opts.disabled,
      title: opts.title,
      "data-testid": opts.testid,
    },
    opts.icon ? icon(opts.icon, opts.small ? 14 : 16) : null,
    label ? h("span", null, label) : null,
  );
}

let toastRoot = null;

/** A short message in the corner; `kind` is "ok", "error" or "info". */
export function toast(message, kind = "info", ms = 5000) {
  if (!toastRoot || !toastRoot.isConnected) {
    toastRoot = h("div", { class: "toasts", "aria-live": "polite" });
    document.body.appendChild(toastRoot);
  }
  const close = () => el.remove();
  const el = h(
    "div",
    { class: `toast toast-${kind}`, role: kind === "error" ? "alert" : "status" },
    h("span", { class: "toast-text" }, message),
    h("button", { type: "button", class: "toast-close", "aria-label": "Dismiss", onclick: close }, icon("x", 14)),
  );
  toastRoot.appendChild(el);
  if (ms) setTimeout(close, kind === "error" ? ms * 2 : ms);
  return el;
}

/** Field wrapper: a label above an input. */
export function field(label, input, hint) {
  return h("label", { class: "field" }, h("span", { class: "field-label" }, label), input, hint ? h("span", { class: "field-hint" }, hint) : null);
}

/** A modal dialog; returns { el, close }. */
export function modal(title, body, onClose) {
  const close = () => {
    document.removeEventListener("keydown", onKey);
    overlay.remove();
    onClose?.();
  };
  const onKey = (e) => {
    if (e.key === "Escape") close();
  };
  const overlay = h(
    "div",
    {
      class: "modal-overlay",
      onmousedown: (e) => {
        if (e.target === overlay) close();
      },
    },
    h(
      "div",
      { class: "modal", role: "dialog", "aria-modal": "true", "aria-label": title },
      h("div", { class: "modal-head" }, h("h2", null, title), h("button", { type: "button", class: "icon-btn", "aria-label": "Close", onclick: close }, icon("x"))),
      body,
    ),
  );
  document.addEventListener("keydown", onKey);
  document.body.appendChild(overlay);
  const first = overlay.querySelector("input, select, textarea");
  if (first) first.focus();
  return { el: overlay, close };
}
