// #/templates: the templates this key can use, and building one from a recipe
// (`POST /v1/templates` → a `build` operation, its log followed live with
// `GET /v1/operations/{id}/log?follow=true`).

import { h, replace, icon } from "../dom.js";
import { api, describe, readLines } from "../api.js";
import { badge, bytes, time } from "../format.js";
import { button, emptyState, errorState, field, fullRow, loading, pageHeader, toast } from "../ui.js";
import { follow } from "../ops.js";

const COLS = 6;
const EXAMPLE = `{
  "files": [{ "path": "/etc/motd", "content": "hello from my template\\n" }],
  "steps": [{ "run": "echo built > /version" }]
}`;

export function renderTemplates(ctx, view) {
  let templates = null;
  let error = null;
  const tbody = h("tbody");

  async function load() {
    try {
      const r = await api("/v1/templates", { signal: ctx.signal });
      templates = (r.templates || []).slice().sort((a, b) => (a.builtin === b.builtin ? a.name.localeCompare(b.name) : a.builtin ? -1 : 1));
      error = null;
      fillBases();
    } catch (e) {
      if (e.name === "AbortError") return;
      if (!templates) error = e;
      else toast("Could not refresh templates: " + describe(e), "error");
    }
    draw();
  }

  function draw() {
    if (error) return replace(tbody, fullRow(COLS, errorState("Could not load templates", error, () => load())));
    if (!templates) return replace(tbody, fullRow(COLS, loading("Loading templates…")));
    if (!templates.length) return replace(tbody, fullRow(COLS, emptyState("No templates", "Build one from a recipe with the form.")));
    replace(
      tbody,
      templates.map((t) =>
        h(
          "tr",
          { "data-testid": "template-row", "data-name": t.name },
          h("td", { class: "nowrap" }, h("strong", null, t.name), t.builtin ? h("span", { class: "chip chip-muted" }, "built-in") : null),
          h("td", null, t.ready ? badge("ready", "template-state") : badge("pending", "template-state")),
          h("td", { class: "mono nowrap" }, t.version || "—", t.versions && t.versions.length > 1 ? h("div", { class: "cell-note" }, `${t.versions.length} versions`) : null),
          h("td", null, t.base ? h("span", { class: "mono" }, t.base) : h("span", { class: "muted" }, t.builtin ? "built in" : "—")),
          h("td", { class: "nowrap" }, t.size_bytes !== null && t.size_bytes !== undefined ? bytes(t.size_bytes) : "—", h("div", { class: "cell-note" }, time(t.created_at))),
          h(
            "td",
            { class: "row-actions" },
            t.builtin ? null : button("", () => remove(t), { small: true, kind: "ghost-danger", icon: "trash", title: `Delete ${t.name}`, testid: "template-delete" }),
          ),
        ),
      ),
    );
  }

  async function remove(t) {
    if (!window.confirm(`Delete the template ${t.name}? Sandboxes can no longer be created from it.`)) return;
    try {
      await api(`/v1/templates/${encodeURIComponent(t.name)}`, { method: "DELETE" });
      toast(`Deleted ${t.name}`, "ok");
      load();
    } catch (e) {
      toast(`Could not delete ${t.name}: ${describe(e)}`, "error");
    }
  }

  // The build form.
  const nameInput = h("input", { type: "text", placeholder: "my-tools", pattern: "[a-z0-9][a-z0-9._\\-]{0,62}", required: true, "data-testid": "template-build-name", spellcheck: "false" });
  const baseSel = h("select", { "data-testid": "template-build-base" });
  const recipe = h("textarea", { rows: "8", spellcheck: "false", class: "mono", "data-testid": "template-build-recipe" });
  recipe.value = EXAMPLE;
  const formError = h("p", { class: "form-error", role: "alert", hidden: true, "data-testid": "template-build-error" });
  const submit = h("button", { type: "submit", class: "btn btn-primary", "data-testid": "template-build-submit" }, icon("play", 14), h("span", null, "Build"));

  function fillBases() {
    const prev = baseSel.value;
    const opts = [
      ["busybox", "busybox"],
      ["debian:bookworm", "debian:bookworm (packages allowed)"],
    ];
    for (const t of templates || []) if (!t.builtin) opts.push([`template:${t.name}`, `template:${t.name}`]);
    replace(baseSel, opts.map(([v, l]) => h("option", { value: v }, l)));
    if (prev && opts.some(([v]) => v === prev)) baseSel.value = prev;
  }
  fillBases();

  const buildStatus = h("div", { class: "op-status", "data-testid": "template-build-status", hidden: true });
  const logPre = h("pre", { class: "output build-log", "data-testid": "build-log" });
  const logBox = h("div", { class: "card build-box", hidden: true }, h("div", { class: "card-head" }, h("h2", null, "Build log")), buildStatus, logPre);
  let logAbort = null;
  ctx.cleanup(() => logAbort?.abort());

  const form = h(
    "form",
    {
      class: "form",
      novalidate: true,
      onsubmit: async (e) => {
        e.preventDefault();
        formError.hidden = true;
        const name = nameInput.value.trim();
        if (!/^[a-z0-9][a-z0-9._-]{0,62}$/.test(name)) return fail("The name must be lowercase letters, digits, '.', '_' or '-', starting with a letter or digit (at most 63).");
        let body = {};
        const text = recipe.value.trim();
        if (text) {
          try {
            body = JSON.parse(text);
          } catch (err) {
            return fail("The recipe is not valid JSON: " + err.message);
          }
          if (!body || typeof body !== "object" || Array.isArray(body)) return fail("The recipe must be a JSON object.");
        }
        body = { ...body, name, base: body.base || baseSel.value };
        submit.disabled = true;
        try {
          const op = await api("/v1/templates", { method: "POST", json: body });
          startLog(op);
        } catch (err) {
          fail(describe(err));
        } finally {
          submit.disabled = false;
        }
      },
    },
    h("div", { class: "form-grid" }, field("Name", nameInput), field("Base", baseSel, "A recipe's own \"base\" wins.")),
    field("Recipe (JSON)", recipe, "files, steps, env, workdir, user, resources, start, packages — as in a recipe file, in JSON."),
    formError,
    h("div", { class: "form-actions" }, submit),
  );

  function fail(text) {
    formError.textContent = text;
    formError.hidden = false;
  }

  function drawBuild(op) {
    buildStatus.hidden = false;
    buildStatus.dataset.status = op.status;
    const ended = ["succeeded", "failed", "cancelled"].includes(op.status);
    replace(
      buildStatus,
      ended ? icon(op.status === "succeeded" ? "check" : "alert", 16) : h("span", { class: "spinner sm" }),
      h(
        "span",
        { class: "op-text" },
        h("strong", null, op.template || "template"),
        badge(op.status, "build-state"),
        op.progress ? ` ${op.progress}` : "",
        op.error ? [" — ", h("span", { class: "error-text" }, op.error.message)] : "",
      ),
      h("span", { class: "mono muted" }, op.id),
    );
  }

  async function startLog(op) {
    logAbort?.abort();
    const ac = new AbortController();
    logAbort = ac;
    logBox.hidden = false;
    replace(logPre);
    logBox.scrollIntoView({ block: "nearest" });
    follow(op, drawBuild, ac.signal).then((end) => {
      if (ac.signal.aborted) return;
      if (end.status === "succeeded") toast(`Built ${end.template}`, "ok");
      load();
    });
    try {
      const resp = await api(`/v1/operations/${encodeURIComponent(op.id)}/log`, { raw: true, query: { follow: "true" }, signal: ac.signal });
      await readLines(
        resp,
        (line) => {
          const atEnd = logPre.scrollTop + logPre.clientHeight >= logPre.scrollHeight - 4;
          logPre.appendChild(h("span", { class: line.startsWith("==>") ? "log-step" : null }, line + "\n"));
          if (atEnd) logPre.scrollTop = logPre.scrollHeight;
        },
        ac.signal,
      );
    } catch (e) {
      if (e.name === "AbortError") return;
      logPre.appendChild(h("span", { class: "error-text" }, `[could not read the log: ${describe(e)}]\n`));
    }
  }

  replace(
    view,
    pageHeader("Templates", "Root filesystems that sandboxes start from.", button("Refresh", () => load(), { icon: "refresh", kind: "ghost" })),
    h(
      "div",
      { class: "split" },
      h(
        "div",
        { class: "stack" },
        h(
          "div",
          { class: "card table-card" },
          h("table", { class: "table" }, h("thead", null, h("tr", null, ["Name", "State", "Version", "Base", "Size · created", ""].map((c) => h("th", null, c)))), tbody),
        ),
        logBox,
      ),
      h("div", { class: "card side-card" }, h("div", { class: "card-head" }, h("h2", null, "Build template")), form),
    ),
  );
  draw();
  load();
}
