// The Terminal tab: a shell on a pseudo-terminal (`POST …/commands` with `pty`), shown
// in xterm.js and wired to the attach WebSocket. The token travels as a subprotocol
// (`space.bearer.<base64url>`), never in the URL. Output arrives as binary messages
// (first byte: stream); keystrokes go back as binary; resizes as `{"type":"resize"}`.

import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import { h, replace, icon } from "../dom.js";
import { api, base64url, describe, getKey } from "../api.js";
import { button } from "../ui.js";

const SHELLS = [
  ["/bin/sh", "sh"],
  ["/bin/bash", "bash"],
];

export function mountTerminal(ctx, panel, sandbox) {
  const id = sandbox.id;
  let term = null;
  let fit = null;
  let ws = null;
  let cmd = null; // the shell command
  let exited = false;
  let visible = false;
  let lastSize = null;
  const enc = new TextEncoder();

  const shellSel = h("select", { "data-testid": "terminal-shell", "aria-label": "Shell" }, SHELLS.map(([v, l]) => h("option", { value: v }, l)));
  const openBtn = button("Open terminal", () => open(), { kind: "primary", icon: "terminal", testid: "terminal-open" });
  const intro = h(
    "div",
    { class: "state-box terminal-intro" },
    h("div", { class: "state-icon" }, icon("terminal", 28)),
    h("h3", null, "Interactive shell"),
    h("p", null, "Starts a shell on a pseudo-terminal inside the sandbox and attaches to it. It is listed under Commands like any other command; leaving this page hangs it up."),
    h("div", { class: "state-actions" }, h("label", { class: "inline-field" }, h("span", null, "Shell"), shellSel), openBtn),
    h("p", { class: "form-error", role: "alert", hidden: true }),
  );
  const introError = intro.querySelector(".form-error");

  const statusText = h("span", { class: "term-status-text" });
  const statusDot = h("span", { class: "dot" });
  const barActions = h("div", { class: "term-actions" });
  const bar = h("div", { class: "term-bar" }, h("div", { class: "term-status" }, statusDot, statusText), barActions);
  const host = h("div", { class: "terminal-host", "data-testid": "terminal" });
  const box = h("div", { class: "terminal-box", hidden: true }, bar, host);
  replace(panel, intro, box);

  function setStatus(kind, text, actions = []) {
    bar.dataset.state = kind;
    statusText.textContent = text;
    replace(barActions, actions);
  }

  function runningActions() {
    return [
      button("Ctrl-C", () => sendControl({ type: "signal", signal: "INT" }), { small: true, kind: "ghost", title: "Send SIGINT to the shell's process group" }),
      button("Close", () => close(true), { small: true, kind: "ghost", icon: "x", testid: "terminal-close", title: "Hang up the shell and close the terminal" }),
    ];
  }

  function endedActions(reconnect) {
    return [
      reconnect ? button("Reconnect", () => attach(true), { small: true, icon: "refresh", testid: "terminal-reconnect" }) : null,
      button("New terminal", () => open(), { small: true, kind: "primary", icon: "plus", testid: "terminal-new" }),
    ];
  }

  function sendControl(msg) {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(msg));
  }

  function ensureTerm() {
    if (term) return;
    term = new Terminal({
      cursorBlink: true,
      convertEol: false,
      fontFamily: 'ui-monospace, "DejaVu Sans Mono", "Liberation Mono", Menlo, Consolas, monospace',
      fontSize: 14,
      lineHeight: 1.15,
      scrollback: 5000,
      theme: {
        background: "#0f172a",
        foreground: "#e2e8f0",
        cursor: "#93c5fd",
        selectionBackground: "#334155",
      },
    });
    fit = new FitAddon();
    term.loadAddon(fit);
    term.open(host);
    term.onData((d) => {
      if (ws && ws.readyState === WebSocket.OPEN && !exited) ws.send(enc.encode(d));
    });
    term.onBinary((d) => {
      if (!ws || ws.readyState !== WebSocket.OPEN || exited) return;
      const b = new Uint8Array(d.length);
      for (let i = 0; i < d.length; i++) b[i] = d.charCodeAt(i) & 255;
      ws.send(b);
    });
    term.onResize(({ rows, cols }) => sendResize(rows, cols));
  }

  function sendResize(rows, cols) {
    const key = `${rows}x${cols}`;
    if (key === lastSize) return;
    if (ws && ws.readyState === WebSocket.OPEN && !exited) {
      ws.send(JSON.stringify({ type: "resize", rows, cols }));
      lastSize = key;
    }
  }

  /** Makes the terminal fill the window below its top edge (never less than 260 px). */
  function sizeHost() {
    const top = host.getBoundingClientRect().top + window.scrollY;
    const height = Math.max(260, Math.floor(window.innerHeight - top - 24));
    if (host.style.height !== `${height}px`) host.style.height = `${height}px`;
  }

  function refit() {
    if (!term || !visible || box.hidden || !host.offsetParent) return;
    sizeHost();
    try {
      fit.fit();
    } catch {
      /* not laid out yet */
    }
  }

  let resizeTimer = null;
  const onWindowResize = () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(refit, 80);
  };
  window.addEventListener("resize", onWindowResize);
  const ro = new ResizeObserver(onWindowResize);
  ro.observe(host);
  ro.observe(document.body);

  async function open() {
    const sb = sandbox.get();
    introError.hidden = true;
    if (sb && sb.state !== "running") {
      showIntroError(`The sandbox is ${sb.state}; a terminal needs it running.`);
      return;
    }
    hangUp();
    openBtn.disabled = true;
    intro.hidden = true;
    box.hidden = false;
    ensureTerm();
    term.reset();
    refit();
    setStatus("busy", "Starting a shell…");
    try {
      cmd = await api(`/v1/sandboxes/${encodeURIComponent(id)}/commands`, {
        method: "POST",
        json: { argv: [shellSel.value], pty: { rows: term.rows, cols: term.cols }, env: { TERM: "xterm-256color" } },
        signal: ctx.signal,
      });
    } catch (e) {
      syncOpen(sandbox.get());
      if (e.name === "AbortError") return;
      box.hidden = true;
      intro.hidden = false;
      showIntroError("Could not start the shell: " + describe(e));
      return;
    }
    syncOpen(sandbox.get());
    attach(false);
  }

  function showIntroError(text) {
    box.hidden = true;
    intro.hidden = false;
    introError.textContent = text;
    introError.hidden = false;
  }

  function attach(replay) {
    if (!cmd) return;
    if (ws) {
      ws.onclose = null;
      ws.close();
    }
    exited = false;
    lastSize = null;
    if (replay) term.reset();
    setStatus("busy", "Connecting…");
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const url = `${scheme}//${location.host}/v1/sandboxes/${encodeURIComponent(id)}/commands/${encodeURIComponent(cmd.id)}/attach`;
    let socket;
    try {
      socket = new WebSocket(url, ["space.attach.v1", "space.bearer." + base64url(getKey() || "")]);
    } catch (e) {
      setStatus("error", "Could not connect: " + (e.message || e), endedActions(true));
      return;
    }
    ws = socket;
    socket.binaryType = "arraybuffer";
    let opened = false;
    let ended = null;
    socket.onopen = () => {
      opened = true;
      setStatus("live", `Connected · ${cmd.argv.join(" ")} · ${cmd.id}`, runningActions());
      refit();
      const { rows, cols } = term;
      sendResize(rows, cols);
      term.focus();
    };
    socket.onmessage = (ev) => {
      if (typeof ev.data === "string") {
        let m;
        try {
          m = JSON.parse(ev.data);
        } catch {
          return;
        }
        if (m.type === "exit") {
          ended = m;
          exited = true;
        } else if (m.type === "error") {
          term.write(`\r\n\x1b[31m[${m.message}]\x1b[0m\r\n`);
        }
        return;
      }
      const data = new Uint8Array(ev.data);
      if (data.length > 1) term.write(data.subarray(1));
    };
    socket.onclose = () => {
      if (ws !== socket) return;
      ws = null;
      if (ended) {
        const r = ended.result || {};
        const how = r.signal !== null && r.signal !== undefined ? `killed by signal ${r.signal}` : r.exit_code !== null && r.exit_code !== undefined ? `exited with code ${r.exit_code}` : ended.state;
        term.write(`\r\n\x1b[2m[the shell ${how}]\x1b[0m\r\n`);
        setStatus("ended", `The shell ${how}.`, endedActions(false));
      } else if (!opened) {
        setStatus("error", "Could not attach to the shell (the sandbox may have stopped, or the key was revoked).", endedActions(true));
      } else {
        term.write(`\r\n\x1b[33m[disconnected]\x1b[0m\r\n`);
        setStatus("error", "Disconnected. The shell may still be running: reconnect to pick it up.", endedActions(true));
      }
    };
  }

  /** Hangs up the current shell (SIGHUP, as a terminal closing would) and detaches. */
  function hangUp() {
    if (ws) {
      const socket = ws;
      ws = null;
      socket.onclose = null;
      if (socket.readyState === WebSocket.OPEN && !exited) socket.send(JSON.stringify({ type: "signal", signal: "HUP" }));
      socket.close();
    }
  }

  function close(userAction) {
    hangUp();
    if (userAction) {
      box.hidden = true;
      intro.hidden = false;
    }
  }

  const onPageHide = () => hangUp();
  window.addEventListener("pagehide", onPageHide);
  ctx.cleanup(() => {
    window.removeEventListener("resize", onWindowResize);
    window.removeEventListener("pagehide", onPageHide);
    ro.disconnect();
    hangUp();
    term?.dispose();
  });

  // Only a running sandbox can start a shell.
  const syncOpen = (sb) => {
    openBtn.disabled = !sb || sb.state !== "running";
    openBtn.title = openBtn.disabled && sb ? `The sandbox is ${sb.state}` : "";
  };
  ctx.cleanup(sandbox.onChange(syncOpen));

  return {
    show() {
      syncOpen(sandbox.get());
      visible = true;
      requestAnimationFrame(() => {
        refit();
        if (term && ws) term.focus();
      });
    },
    hide() {
      visible = false;
    },
  };
}
