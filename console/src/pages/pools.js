// #/pools: warm pools (`GET /v1/pools`, `PUT /v1/pools`, `DELETE /v1/pools/{id}`).
// Pools are the operator's: only the server's token may see or change them, and a
// tenant key gets 403, which is shown as such rather than as a failure.

import { h, replace, icon } from "../dom.js";
import { api, ApiError, describe } from "../api.js";
import { badge, resources, time, mib } from "../format.js";
import { button, emptyState, errorState, field, fullRow, loading, pageHeader, toast } from "../ui.js";

const COLS = 8;

function forbiddenState(err) {
  return h(
    "div",
    { class: "state-box notice", "data-testid": "error-state", "data-kind": "forbidden" },
    h("div", { class: "state-icon" }, icon("lock", 28)),
    h("h3", null, "Warm pools are managed by the operator"),
    h(
      "p",
      null,
      "Only the server's own token (SPACE_API_TOKEN, or the dev token in dev mode) can see or change pools; this key belongs to a tenant. ",
      "Your creates still use pools: a create whose template, runtime, resources and network match a pool gets one of its ready sandboxes.",
    ),
    h("p", { class: "muted small" }, `The server said: ${err.message} (403 ${err.code})`),
  );
}

export function renderPools(ctx, view) {
  let pools = null;
  let error = null;
  let timer = null;
  const tbody = h("tbody");
  const formCard = h("div", { class: "card side-card" });
  const split = h("div", { class: "split" });

  async function load() {
    clearTimeout(timer);
    try {
      const r = await api("/v1/pools", { signal: ctx.signal });
      pools = r.pools || [];
      error = null;
    } catch (e) {
      if (e.name === "AbortError") return;
      error = e;
    }
    draw();
    if (!(error instanceof ApiError && error.status === 403)) timer = setTimeout(load, pools && pools.some((p) => p.starting > 0 || p.ready < p.size) ? 2000 : 8000);
  }
  ctx.cleanup(() => clearTimeout(timer));

  function draw() {
    if (error instanceof ApiError && error.status === 403) {
      replace(split, h("div", { class: "card" }, forbiddenState(error)));
      split.classList.add("single");
      return;
    }
    split.classList.remove("single");
    if (!split.contains(formCard)) replace(split, h("div", { class: "card table-card" }, table), formCard);
    if (error && !pools) return replace(tbody, fullRow(COLS, errorState("Could not load pools", error, () => load())));
    if (!pools) return replace(tbody, fullRow(COLS, loading("Loading pools…")));
    if (!pools.length) return replace(tbody, fullRow(COLS, emptyState("No warm pools", "Keep ready sandboxes of a template so that creates start instantly: set one with the form.")));
    replace(
      tbody,
      pools.map((p) =>
        h(
          "tr",
          { "data-testid": "pool-row", "data-id": p.id },
          h("td", null, h("strong", null, p.template), h("div", { class: "cell-note mono" }, p.id)),
          h("td", null, p.runtime, h("div", { class: "cell-note" }, `network ${p.network}`)),
          h("td", { class: "nowrap" }, resources(p.resources), p.resources && p.resources.disk_mib ? h("div", { class: "cell-note" }, `disk ${mib(p.resources.disk_mib)}`) : null),
          h("td", { class: "num" }, String(p.size)),
          h("td", null, h("span", { class: "pool-fill" }, badge(p.ready >= p.size ? "ready" : "starting", "pool-state"), ` ${p.ready} ready`, p.starting ? ` · ${p.starting} booting` : "")),
          h("td", { class: "num" }, String(p.claims)),
          h("td", { class: "error-cell" }, p.last_error ? h("span", { class: "error-text", title: p.last_error }, p.last_error) : h("span", { class: "muted" }, "—"), h("div", { class: "cell-note" }, "updated ", time(p.updated_at))),
          h(
            "td",
            { class: "row-actions" },
            button("", () => resize(p), { small: true, kind: "ghost", icon: "refresh", title: "Change its size" }),
            button("", () => remove(p), { small: true, kind: "ghost-danger", icon: "trash", title: "Remove the pool", testid: "pool-delete" }),
          ),
        ),
      ),
    );
  }

  async function put(body) {
    const p = await api("/v1/pools", { method: "PUT", json: body });
    toast(`Pool of ${p.template} set to ${p.size}`, "ok");
    load();
    return p;
  }

  async function resize(p) {
    const v = window.prompt(`New size of the ${p.template} pool (0 keeps it, empty):`, String(p.size));
    if (v === null) return;
    const size = Number(v);
    if (!Number.isInteger(size) || size < 0) return toast("The size must be a whole number ≥ 0", "error");
    try {
      await put({ template: p.template, size, runtime: p.runtime, network: p.network, resources: p.resources });
    } catch (e) {
      toast(`Could not resize: ${describe(e)}`, "error");
    }
  }

  async function remove(p) {
    if (!window.confirm(`Remove the ${p.template} pool (${p.id})? Its ready sandboxes are destroyed.`)) return;
    try {
      await api(`/v1/pools/${encodeURIComponent(p.id)}`, { method: "DELETE" });
      toast(`Removed the ${p.template} pool`, "ok");
      load();
    } catch (e) {
      toast(`Could not remove the pool: ${describe(e)}`, "error");
    }
  }

  // The "set a pool" form.
  const tplSel = h("select", { "data-testid": "pool-template" });
  const size = h("input", { type: "number", min: "0", value: "1", "data-testid": "pool-size" });
  const runtimeSel = h("select", { "data-testid": "pool-runtime" }, h("option", { value: "" }, "Server default"));
  const vcpus = h("input", { type: "number", min: "1", placeholder: "default" });
  const memory = h("input", { type: "number", min: "64", step: "64", placeholder: "default" });
  const formError = h("p", { class: "form-error", role: "alert", hidden: true });
  const submit = h("button", { type: "submit", class: "btn btn-primary", "data-testid": "pool-submit" }, icon("plus", 14), h("span", null, "Set pool"));
  const form = h(
    "form",
    {
      class: "form",
      novalidate: true,
      onsubmit: async (e) => {
        e.preventDefault();
        formError.hidden = true;
        const n = Number(size.value);
        if (!Number.isInteger(n) || n < 0) {
          formError.textContent = "The size must be a whole number ≥ 0.";
          formError.hidden = false;
          return;
        }
        const body = { template: tplSel.value, size: n };
        if (runtimeSel.value) body.runtime = runtimeSel.value;
        const res = {};
        if (vcpus.value) res.vcpus = Number(vcpus.value);
        if (memory.value) res.memory_mib = Number(memory.value);
        if (Object.keys(res).length) body.resources = res;
        submit.disabled = true;
        try {
          await put(body);
        } catch (err) {
          formError.textContent = err instanceof ApiError && err.status === 403 ? "Only the server's token may manage pools." : describe(err);
          formError.hidden = false;
        } finally {
          submit.disabled = false;
        }
      },
    },
    h("div", { class: "form-grid" }, field("Template", tplSel), field("Size", size, "Ready sandboxes to keep")),
    field("Runtime", runtimeSel),
    h("div", { class: "form-grid" }, field("vCPUs", vcpus), field("Memory (MiB)", memory)),
    h("p", { class: "muted small" }, "Putting the same template, runtime, resources and network again changes that pool's size."),
    formError,
    h("div", { class: "form-actions" }, submit),
  );
  replace(formCard, h("div", { class: "card-head" }, h("h2", null, "Set a pool")), form);
  const table = h("table", { class: "table" }, h("thead", null, h("tr", null, ["Template", "Runtime", "Resources", "Size", "Fill", "Claims", "Last error", ""].map((c) => h("th", null, c)))), tbody);

  (async () => {
    try {
      const [t, r] = await Promise.all([api("/v1/templates", { signal: ctx.signal }), api("/v1/runtimes", { signal: ctx.signal }).catch(() => ({ runtimes: [] }))]);
      replace(tplSel, (t.templates || []).map((x) => h("option", { value: x.name }, x.name)));
      for (const rt of r.runtimes || []) runtimeSel.appendChild(h("option", { value: rt.name, disabled: !rt.available }, `${rt.name}${rt.default ? " (default)" : ""}${rt.available ? "" : " — unavailable"}`));
    } catch {
      /* the form still takes a typed template via the list's names */
    }
  })();

  replace(view, pageHeader("Warm pools", "Ready sandboxes that matching creates claim instead of booting.", button("Refresh", () => load(), { icon: "refresh", kind: "ghost" })), split);
  draw();
  load();
}
