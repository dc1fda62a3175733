// The Files tab: browse (`GET …/files/list`), upload (`PUT …/files?path=` with the raw
// bytes), download (fetched with the bearer, handed to the browser as a blob) and
// delete (`DELETE …/files?path=`). Every path is resolved inside the sandbox.

import { h, replace, icon } from "../dom.js";
import { api, ApiError, describe } from "../api.js";
import { bytes, modeString, time } from "../format.js";
import { button, emptyState, errorState, fullRow, loading, noticeState, toast } from "../ui.js";

const COLS = 6;

function join(dir, name) {
  return dir === "/" ? "/" + name : dir + "/" + name;
}

function parent(path) {
  if (path === "/") return "/";
  const i = path.lastIndexOf("/");
  return i <= 0 ? "/" : path.slice(0, i);
}

/** A clean absolute path: leading slash, no empty or "." parts, no trailing slash. */
function normalize(p) {
  const parts = [];
  for (const part of String(p || "/").split("/")) {
    if (!part || part === ".") continue;
    if (part === "..") parts.pop();
    else parts.push(part);
  }
  return "/" + parts.join("/");
}

export function mountFiles(ctx, panel, sandbox) {
  const id = sandbox.id;
  const base = `/v1/sandboxes/${encodeURIComponent(id)}/files`;
  let path = "/";
  let entries = null;
  let error = null;
  let seq = 0;
  let loadedOnce = false;

  const pathInput = h("input", {
    type: "text",
    value: path,
    "data-testid": "files-path",
    "aria-label": "Directory path",
    spellcheck: "false",
    autocomplete: "off",
    onkeydown: (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        go(pathInput.value);
      }
    },
  });
  const upInput = h("input", {
    type: "file",
    multiple: true,
    class: "visually-hidden",
    id: `upload-${id}`,
    "data-testid": "file-upload",
    onchange: () => upload([...upInput.files]),
  });
  const upLabel = h("label", { class: "btn btn-primary", for: `upload-${id}`, tabindex: "0", onkeydown: (e) => (e.key === "Enter" || e.key === " ") && upInput.click() }, icon("upload"), h("span", null, "Upload"));
  const status = h("div", { class: "files-status", "aria-live": "polite" });
  const tbody = h("tbody");
  const crumbs = h("div", { class: "path-crumbs" });

  replace(
    panel,
    h(
      "div",
      { class: "card" },
      h(
        "div",
        { class: "files-bar" },
        button("", () => go(parent(path)), { icon: "up", kind: "ghost", title: "Parent directory", testid: "files-up" }),
        h("div", { class: "path-box" }, icon("folder", 15), pathInput),
        button("Go", () => go(pathInput.value), { kind: "ghost" }),
        button("", () => list(), { icon: "refresh", kind: "ghost", title: "Refresh" }),
        h("span", { class: "spacer" }),
        upInput,
        upLabel,
      ),
      crumbs,
      status,
      h(
        "div",
        { class: "table-scroll files-scroll" },
        h("table", { class: "table compact files" }, h("thead", null, h("tr", null, ["Name", "Size", "Mode", "Owner", "Modified", ""].map((c) => h("th", null, c)))), tbody),
      ),
    ),
  );

  function setStatus(text, kind = "info") {
    if (!text) {
      replace(status);
      status.hidden = true;
      return;
    }
    status.hidden = false;
    status.dataset.kind = kind;
    replace(status, kind === "busy" ? h("span", { class: "spinner sm" }) : icon(kind === "error" ? "alert" : kind === "ok" ? "check" : "file", 14), h("span", null, text));
  }
  setStatus("");

  function drawCrumbs() {
    const parts = path.split("/").filter(Boolean);
    const items = [h("a", { href: "#", onclick: (e) => (e.preventDefault(), go("/")) }, "/")];
    let acc = "";
    parts.forEach((p, i) => {
      acc += "/" + p;
      const target = acc;
      if (i > 0) items.push(h("span", { class: "sep" }, "/"));
      items.push(i === parts.length - 1 ? h("span", null, p) : h("a", { href: "#", onclick: (e) => (e.preventDefault(), go(target)) }, p));
    });
    replace(crumbs, items);
  }

  function go(p) {
    path = normalize(p);
    pathInput.value = path;
    list();
  }

  async function list() {
    const my = ++seq;
    entries = null;
    error = null;
    draw();
    try {
      const r = await api(`${base}/list`, { query: { path }, signal: ctx.signal });
      if (my !== seq) return;
      entries = (r.entries || []).slice().sort((a, b) => {
        const da = a.type === "dir" ? 0 : 1;
        const db = b.type === "dir" ? 0 : 1;
        return da - db || a.name.localeCompare(b.name);
      });
      if (r.truncated) setStatus("This directory has more entries than the listing returns; only the first ones are shown.", "info");
    } catch (e) {
      if (e.name === "AbortError" || my !== seq) return;
      error = e;
    }
    draw();
  }

  /** Files are served by the sandbox's agent: only while it runs. */
  function notRunningView(sb) {
    const resumable = sb.state === "paused" || sb.state === "suspended";
    const text = resumable
      ? "Files are read and written by the sandbox itself, so it has to run: resume it to browse them."
      : sb.state === "destroyed"
        ? "Its files were deleted with it."
        : sb.state === "failed"
          ? "A failed sandbox has no files to show; destroy it and create another."
          : "Files can be browsed once it runs.";
    return noticeState(
      resumable ? "moon" : sb.state === "destroyed" || sb.state === "failed" ? "alert" : "refresh",
      `The sandbox is ${sb.state}`,
      text,
      resumable ? button("Resume", () => sandbox.resume(), { kind: "primary", icon: "play" }) : null,
    );
  }

  function errorView(e) {
    const sb = sandbox.get();
    if (sb && sb.state !== "running" && (!(e instanceof ApiError) || e.status === 409 || e.status === 503)) return notRunningView(sb);
    if (e instanceof ApiError && e.status === 404) return errorState("No such directory", `${path} does not exist in this sandbox.`, () => go("/"));
    if (e instanceof ApiError && e.code === "not_a_file") return errorState("Not a directory", `${path} is a file; download it from its parent directory.`, () => go(parent(path)));
    return errorState("Could not list " + path, e, () => list());
  }

  let blocked = false; // the sandbox is not running: nothing to list
  let lastState = null;
  function draw() {
    drawCrumbs();
    const sb = sandbox.get();
    upLabel.classList.toggle("disabled", blocked);
    upInput.disabled = blocked;
    if (blocked && sb) {
      replace(tbody, fullRow(COLS, notRunningView(sb)));
      return;
    }
    if (error) {
      replace(tbody, fullRow(COLS, errorView(error)));
      return;
    }
    if (!entries) {
      replace(tbody, fullRow(COLS, loading(`Listing ${path}…`)));
      return;
    }
    const rows = [];
    if (path !== "/") {
      rows.push(
        h(
          "tr",
          { class: "clickable", "data-testid": "file-row", "data-name": "..", onclick: () => go(parent(path)) },
          h("td", { class: "name-cell" }, h("span", { class: "name-wrap" }, icon("up", 15), h("a", { href: "#", onclick: (e) => e.preventDefault() }, ".."))),
          h("td", { colspan: String(COLS - 1), class: "muted" }, "parent directory"),
        ),
      );
    }
    for (const e of entries) rows.push(row(e));
    if (!entries.length) rows.push(fullRow(COLS, emptyState("This directory is empty", "Upload files into it with the Upload button.")));
    replace(tbody, rows);
  }

  function row(e) {
    const full = e.path || join(path, e.name);
    const isDir = e.type === "dir";
    const isLink = e.type === "symlink";
    const nameEl = isDir || isLink
      ? h("a", { href: "#", class: "file-name", onclick: (ev) => (ev.preventDefault(), go(full)) }, e.name)
      : h("span", { class: "file-name" }, e.name);
    return h(
      "tr",
      { "data-testid": "file-row", "data-name": e.name, "data-type": e.type, class: isDir ? "clickable" : null, ondblclick: isDir ? () => go(full) : null },
      h("td", { class: "name-cell" }, h("span", { class: "name-wrap" }, icon(isDir ? "folder" : isLink ? "link" : "file", 15), nameEl, isLink && e.target ? h("span", { class: "muted" }, ` → ${e.target}`) : null)),
      h("td", { class: "nowrap num" }, isDir ? h("span", { class: "muted" }, "—") : bytes(e.size)),
      h("td", { class: "mono nowrap" }, modeString(e.mode, e.type)),
      h("td", { class: "nowrap" }, `${e.uid ?? "?"}:${e.gid ?? "?"}`),
      h("td", { class: "nowrap" }, e.mtime ? time(new Date(e.mtime * 1000).toISOString()) : "—"),
      h(
        "td",
        { class: "row-actions" },
        isLink ? null : button("", () => download(e, full), { small: true, kind: "ghost", icon: "download", testid: "file-download", title: isDir ? "Download as .tar" : "Download" }),
        button("", () => remove(e, full), { small: true, kind: "ghost-danger", icon: "trash", testid: "file-delete", title: "Delete" }),
      ),
    );
  }

  async function download(e, full) {
    const isDir = e.type === "dir";
    setStatus(`Downloading ${full}…`, "busy");
    try {
      const resp = await api(base, { raw: true, query: { path: full, format: isDir ? "tar" : undefined } });
      const blob = await resp.blob();
      const href = URL.createObjectURL(blob);
      const a = h("a", { href, download: isDir ? `${e.name}.tar` : e.name, hidden: true });
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(href), 60000);
      setStatus(`Downloaded ${full} (${bytes(blob.size)}).`, "ok");
    } catch (err) {
      setStatus(`Could not download ${full}: ${describe(err)}`, "error");
    }
  }

  async function remove(e, full) {
    const isDir = e.type === "dir";
    if (!window.confirm(isDir ? `Delete the directory ${full} and everything in it?` : `Delete ${full}?`)) return;
    setStatus(`Deleting ${full}…`, "busy");
    try {
      await api(base, { method: "DELETE", query: { path: full, recursive: isDir ? "true" : undefined } });
      setStatus(`Deleted ${full}.`, "ok");
      await list();
    } catch (err) {
      setStatus(`Could not delete ${full}: ${describe(err)}`, "error");
    }
  }

  async function upload(files) {
    if (!files.length) return;
    const dir = path;
    let ok = 0;
    for (const f of files) {
      const target = join(dir, f.name);
      setStatus(`Uploading ${f.name} (${bytes(f.size)}) to ${dir}…`, "busy");
      try {
        await api(base, { method: "PUT", query: { path: target }, body: f, headers: { "Content-Type": "application/octet-stream" } });
        ok++;
      } catch (err) {
        setStatus(`Could not upload ${f.name}: ${describe(err)}`, "error");
        upInput.value = "";
        if (dir === path) list();
        return;
      }
    }
    upInput.value = "";
    setStatus(ok === 1 ? `Uploaded ${files[0].name} (${bytes(files[0].size)}) to ${dir}.` : `Uploaded ${ok} files to ${dir}.`, "ok");
    toast(ok === 1 ? `Uploaded ${files[0].name}` : `Uploaded ${ok} files`, "ok", 3000);
    if (dir === path) list();
  }

  ctx.cleanup(
    sandbox.onChange((sb) => {
      const was = blocked;
      const changed = sb.state !== lastState;
      lastState = sb.state;
      blocked = sb.state !== "running";
      if (!loadedOnce) return;
      if (blocked && changed) {
        seq++; // a listing in flight is moot
        draw();
      } else if (!blocked && (was || error)) list();
    }),
  );

  return {
    show() {
      if (!loadedOnce) {
        loadedOnce = true;
        const sb = sandbox.get();
        blocked = !!sb && sb.state !== "running";
        if (blocked) draw();
        else list();
      }
    },
  };
}
