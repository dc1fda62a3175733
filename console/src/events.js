// The live feed: one `GET /v1/events` stream per signed-in tab, read with fetch (an
// EventSource cannot send the bearer header) and parsed here. After a drop it
// reconnects with `Last-Event-ID`, so no event is missed; the server's `retry:` sets
// the delay. Pages subscribe to `sandbox` and `operation` events and to the status.

import { api, ApiError } from "./api.js";

const listeners = { sandbox: new Set(), operation: new Set() };
const statusListeners = new Set();
/** How long a stream may stay silent (the server sends a keepalive every 15 s). */
const SILENCE_MS = 40000;

let state = { status: "idle", detail: "" };
let controller = null;
let lastId = null;
let retryMs = 1000;
let running = false;
let generation = 0;

export function status() {
  return state;
}

function setStatus(status, detail = "") {
  if (state.status === status && state.detail === detail) return;
  state = { status, detail };
  for (const fn of statusListeners) fn(state);
}

/** Calls fn(state) now and on every change; returns an unsubscribe function. */
export function onStatus(fn) {
  statusListeners.add(fn);
  fn(state);
  return () => statusListeners.delete(fn);
}

/** Calls fn(object, event) for each event of `type`; returns an unsubscribe function. */
export function on(type, fn) {
  listeners[type].add(fn);
  return () => listeners[type].delete(fn);
}

export function start() {
  if (running) return;
  running = true;
  lastId = null;
  const gen = ++generation;
  loop(gen);
}

export function stop() {
  running = false;
  generation++;
  controller?.abort();
  controller = null;
  lastId = null;
  setStatus("idle");
}

async function loop(gen) {
  let attempt = 0;
  while (running && gen === generation) {
    setStatus(attempt === 0 && lastId === null ? "connecting" : "reconnecting");
    try {
      await connect(gen);
      attempt = 0;
    } catch (e) {
      if (!running || gen !== generation) return;
      if (e instanceof ApiError && e.status === 401) return; // api.js signs out
      const detail = e instanceof ApiError ? e.message : "connection lost";
      setStatus("reconnecting", detail);
      attempt++;
    }
    if (!running || gen !== generation) return;
    setStatus("reconnecting", state.detail);
    const wait = attempt > 3 ? Math.min(15000, retryMs * attempt) : retryMs;
    await new Promise((r) => setTimeout(r, wait));
  }
}

async function connect(gen) {
  controller = new AbortController();
  const ctl = controller;
  const headers = {};
  if (lastId !== null) headers["Last-Event-ID"] = String(lastId);
  const resp = await api("/v1/events", { raw: true, signal: ctl.signal, headers });
  if (gen !== generation) {
    resp.body?.cancel().catch(() => {});
    return;
  }
  setStatus("live");
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  let timer = null;
  const arm = () => {
    clearTimeout(timer);
    timer = setTimeout(() => ctl.abort(), SILENCE_MS);
  };
  arm();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      arm();
      buf += dec.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        dispatch(block);
      }
    }
  } catch (e) {
    if (e && e.name === "AbortError" && !running) return;
    throw new ApiError(0, "network", "connection lost");
  } finally {
    clearTimeout(timer);
  }
  throw new ApiError(0, "network", "the server closed the stream");
}

function dispatch(block) {
  let event = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const c = line.indexOf(":");
    const field = c < 0 ? line : line.slice(0, c);
    let value = c < 0 ? "" : line.slice(c + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
    else if (field === "id") id = value;
    else if (field === "retry" && /^\d+$/.test(value)) retryMs = Number(value);
  }
  if (id !== null && /^\d+$/.test(id)) lastId = Number(id);
  if (!data.length || !listeners[event]) return;
  let msg;
  try {
    msg = JSON.parse(data.join("\n"));
  } catch {
    return;
  }
  if (!msg || !msg.object) return;
  for (const fn of listeners[event]) {
    try {
      fn(msg.object, msg);
    } catch (e) {
      console.error("event listener failed", e);
    }
  }
}
