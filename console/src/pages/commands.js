// The Commands tab: the sandbox's commands, and one command's output replayed from any
// byte offset (`GET …/commands/{cid}/output?offset=N&stream=…`, NDJSON of base64
// chunks, then the result), followed live while the command runs.

import { h, replace, icon } from "../dom.js";
import { api, describe, fromBase64, readLines } from "../api.js";
import { badge, bytes, duration, time, refreshTimes, stripAnsi } from "../format.js";
import { button, emptyState, errorState, fullRow, loading } from "../ui.js";

/** The most output shown at once; past it, a larger offset reads on. */
const SHOW_MAX = 2 * 1024 * 1024;
const FINISHED = new Set(["exited", "killed", "timed_out", "lost"]);

export function commandText(c) {
  const a = c.argv || [];
  if (a.length === 3 && a[0] === "/bin/sh" && a[1] === "-c") return a[2];
  return a.map((x) => (/^[\w@%+=:,./-]+$/.test(x) ? x : JSON.stringify(x))).join(" ");
}

function exitText(c) {
  const r = c.result;
  if (!r) return c.state === "lost" ? "lost" : "—";
  if (r.timed_out) return "timed out";
  if (r.oom_killed) return "OOM-killed";
  if (r.signal !== null && r.signal !== undefined) return `signal ${r.signal}`;
  return r.exit_code === null || r.exit_code === undefined ? "—" : String(r.exit_code);
}

export function mountCommands(ctx, panel, sandbox) {
  const id = sandbox.id;
  const base = `/v1/sandboxes/${encodeURIComponent(id)}/commands`;
  let commands = null;
  let listError = null;
  let selected = null;
  let visible = false;
  let timer = null;

  const tbody = h("tbody");
  const runInput = h("input", { type: "text", placeholder: "echo hello; uname -a", "data-testid": "command-input", "aria-label": "Shell command to run", autocomplete: "off", spellcheck: "false" });
  const runBtn = h("button", { type: "submit", class: "btn btn-primary", "data-testid": "command-run" }, icon("play", 14), h("span", null, "Run"));
  const runError = h("p", { class: "form-error", role: "alert", hidden: true });
  const runForm = h(
    "form",
    {
      class: "run-form",
      onsubmit: async (e) => {
        e.preventDefault();
        const shell = runInput.value.trim();
        if (!shell) return;
        runBtn.disabled = true;
        runError.hidden = true;
        try {
          const c = await api(base, { method: "POST", json: { shell } });
          runInput.value = "";
          await refresh();
          select(c.id);
        } catch (err) {
          runError.textContent = describe(err);
          runError.hidden = false;
        } finally {
          runBtn.disabled = false;
        }
      },
    },
    h("span", { class: "prompt mono" }, "$"),
    runInput,
    runBtn,
  );

  // The output viewer.
  const outHead = h("div", { class: "out-head" });
  const offsetInput = h("input", { type: "number", min: "0", step: "1", value: "0", "data-testid": "output-offset", "aria-label": "First byte to show", class: "num" });
  const streamSel = h(
    "select",
    { "data-testid": "output-stream", "aria-label": "Which output" },
    h("option", { value: "combined" }, "stdout + stderr"),
    h("option", { value: "stdout" }, "stdout"),
    h("option", { value: "stderr" }, "stderr"),
  );
  const outPre = h("pre", { class: "output", "data-testid": "command-output", tabindex: "0" });
  const outNote = h("div", { class: "out-note" });
  const outBox = h(
    "div",
    { class: "out-box", hidden: true },
    outHead,
    h(
      "div",
      { class: "out-controls" },
      h("label", { class: "inline-field" }, h("span", null, "From byte"), offsetInput),
      h("label", { class: "inline-field" }, h("span", null, "Stream"), streamSel),
      button("Reload", () => loadOutput(), { small: true, icon: "refresh", kind: "ghost" }),
    ),
    outPre,
    outNote,
  );
  const outEmpty = h("div", { class: "out-empty" }, h("p", { class: "muted" }, "Select a command to see its output."));
  const outSide = h("div", { class: "card out-side" }, outEmpty, outBox);

  let debounce = null;
  offsetInput.addEventListener("input", () => {
    clearTimeout(debounce);
    debounce = setTimeout(loadOutput, 250);
  });
  offsetInput.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      clearTimeout(debounce);
      loadOutput();
    }
  });
  streamSel.addEventListener("change", () => loadOutput());

  replace(
    panel,
    h(
      "div",
      { class: "commands-layout" },
      h(
        "div",
        { class: "card list-side" },
        h("div", { class: "card-head" }, h("h2", null, "Commands"), button("", () => refresh(), { small: true, icon: "refresh", kind: "ghost", title: "Refresh" })),
        runForm,
        runError,
        h("div", { class: "table-scroll" }, h(
            "table",
            { class: "table compact cmds" },
            h("colgroup", null, h("col"), h("col", { style: { width: "104px" } }), h("col", { style: { width: "64px" } }), h("col", { style: { width: "92px" } }), h("col", { style: { width: "76px" } })),
            h("thead", null, h("tr", null, ["Command", "State", "Exit", "Started", "Took"].map((c) => h("th", null, c)))),
            tbody,
          )),
      ),
      outSide,
    ),
  );

  function draw() {
    if (!commands) {
      replace(tbody, fullRow(5, listError ? errorState("Could not list commands", listError, () => refresh()) : loading("Loading commands…")));
      return;
    }
    if (!commands.length) {
      replace(tbody, fullRow(5, emptyState("No commands yet", "Run one above, open a terminal, or start one through the API.")));
      return;
    }
    replace(
      tbody,
      commands.map((c) =>
        h(
          "tr",
          {
            "data-testid": "command-row",
            "data-id": c.id,
            class: ["clickable", selected === c.id ? "selected" : null],
            tabindex: "0",
            onclick: () => select(c.id),
            onkeydown: (e) => {
              if (e.key === "Enter") select(c.id);
            },
          },
          h("td", { class: "cmd-cell" }, h("code", { class: "cmd-text", title: commandText(c) }, commandText(c)), c.pty ? h("span", { class: "chip chip-tty", title: `pseudo-terminal ${c.pty.cols}×${c.pty.rows}` }, "tty") : null),
          h("td", null, badge(c.state, "command-state")),
          h("td", { class: "mono" }, exitText(c)),
          h("td", { class: "nowrap" }, time(c.created_at)),
          h("td", { class: "nowrap" }, c.result ? duration(c.result.duration_ms) : h("span", { class: "muted" }, "—")),
        ),
      ),
    );
  }

  async function refresh() {
    try {
      const list = await api(base, { signal: ctx.signal });
      commands = (list.commands || []).slice().sort((a, b) => (a.created_at < b.created_at ? 1 : a.created_at > b.created_at ? -1 : 0));
      listError = null;
      const cur = commands.find((c) => c.id === selected);
      if (cur) drawOutHead(cur);
    } catch (e) {
      if (e.name === "AbortError") return;
      if (!commands) listError = e;
    }
    draw();
  }

  function drawOutHead(c) {
    replace(
      outHead,
      h("div", { class: "out-title" }, h("code", { class: "cmd-text" }, commandText(c)), badge(c.state, "output-state")),
      h(
        "div",
        { class: "out-meta" },
        h("span", { class: "mono" }, c.id),
        c.result ? h("span", null, `exit ${exitText(c)}`) : null,
        c.result ? h("span", null, `stdout ${bytes(c.result.stdout_bytes)} · stderr ${bytes(c.result.stderr_bytes)}`) : null,
        c.result && c.result.output_truncated ? h("span", { class: "warn-text" }, "head of output dropped (cap)") : null,
        c.lost_reason ? h("span", { class: "error-text" }, c.lost_reason) : null,
      ),
    );
  }

  let outAbort = null;

  function select(cid) {
    if (selected !== cid) offsetInput.value = "0";
    selected = cid;
    draw();
    const c = commands && commands.find((x) => x.id === cid);
    outEmpty.hidden = true;
    outBox.hidden = false;
    if (c) drawOutHead(c);
    loadOutput();
  }

  async function loadOutput() {
    if (!selected) return;
    outAbort?.abort();
    const ac = new AbortController();
    outAbort = ac;
    const c = commands && commands.find((x) => x.id === selected);
    const pty = !!(c && c.pty);
    const offset = Math.max(0, Math.floor(Number(offsetInput.value) || 0));
    const followIt = !c || !FINISHED.has(c.state);
    replace(outPre);
    outPre.classList.remove("is-error");
    outNote.textContent = followIt ? "Following live…" : "Loading…";
    let shown = 0;
    let capped = false;
    let any = false;
    const decoders = { stdout: new TextDecoder(), stderr: new TextDecoder() };
    const add = (stream, text) => {
      if (!text) return;
      any = true;
      const last = outPre.lastChild;
      if (last && last.dataset.stream === stream) last.textContent += text;
      else outPre.appendChild(h("span", { class: `s-${stream}`, "data-stream": stream }, text));
    };
    try {
      const resp = await api(`${base}/${encodeURIComponent(selected)}/output`, {
        raw: true,
        signal: ac.signal,
        query: { offset, stream: streamSel.value, follow: followIt ? "true" : undefined },
      });
      let result = null;
      await readLines(
        resp,
        (line) => {
          if (!line.trim() || capped) return;
          let m;
          try {
            m = JSON.parse(line);
          } catch {
            return;
          }
          if (m.data !== undefined) {
            const data = fromBase64(m.data);
            const stream = m.stream === "stderr" ? "stderr" : "stdout";
            const room = SHOW_MAX - shown;
            const part = data.length > room ? data.subarray(0, room) : data;
            shown += part.length;
            let text = decoders[stream].decode(part, { stream: true });
            if (pty) text = stripAnsi(text);
            add(stream, text);
            if (data.length > room) {
              capped = true;
              ac.abort();
            }
            if (followIt) outPre.scrollTop = outPre.scrollHeight;
          } else if (m.result !== undefined || m.state) {
            result = m;
          }
        },
        ac.signal,
      );
      if (ac !== outAbort) return;
      if (capped) {
        outNote.textContent = `Showing ${bytes(SHOW_MAX)} from byte ${offset}; there is more — set “From byte” to ${offset + SHOW_MAX} to read on.`;
        return;
      }
      if (!any) outPre.appendChild(h("span", { class: "muted" }, offset > 0 ? `No output past byte ${offset}.` : "No output."));
      outNote.textContent = result ? `${bytes(shown)} shown from byte ${offset}${result.state ? ` · ${result.state}` : ""}` : `${bytes(shown)} shown from byte ${offset}`;
      if (followIt) refresh();
    } catch (e) {
      if (ac !== outAbort) return;
      if (capped) {
        outNote.textContent = `Showing ${bytes(SHOW_MAX)} from byte ${offset}; there is more — set “From byte” to ${offset + SHOW_MAX} to read on.`;
        return;
      }
      if (e.name === "AbortError") return;
      outPre.classList.add("is-error");
      replace(outPre, h("span", { class: "error-text" }, "Could not read the output: " + describe(e)));
      outNote.textContent = "";
    }
  }

  function schedule() {
    clearTimeout(timer);
    if (!visible) return;
    const busy = commands && commands.some((c) => !FINISHED.has(c.state));
    timer = setTimeout(async () => {
      await refresh();
      schedule();
    }, busy ? 2000 : 6000);
  }
  ctx.cleanup(() => {
    clearTimeout(timer);
    outAbort?.abort();
  });
  const tick = setInterval(() => visible && refreshTimes(tbody), 15000);
  ctx.cleanup(() => clearInterval(tick));

  draw();
  return {
    show() {
      visible = true;
      refresh().then(schedule);
    },
    hide() {
      visible = false;
      clearTimeout(timer);
    },
  };
}
