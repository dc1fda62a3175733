// Following an operation to its end: `operation` events as they come, with a long-poll
// of `GET /v1/operations/{id}?wait=` as a fallback (events can be delayed by a reconnect).

import { api } from "./api.js";
import * as events from "./events.js";

export const ENDED = new Set(["succeeded", "failed", "cancelled"]);

/**
 * Calls onUpdate(op) with every newer version of the operation until it ends (or
 * `signal` aborts). Resolves to the ended operation (or the last one seen).
 */
export function follow(op, onUpdate, signal) {
  let last = op;
  onUpdate(op);
  return new Promise((resolve) => {
    if (ENDED.has(op.status)) {
      resolve(op);
      return;
    }
    let done = false;
    const poll = new AbortController();
    const finish = () => {
      if (done) return;
      done = true;
      off();
      poll.abort();
      resolve(last);
    };
    const apply = (o) => {
      if (done || o.id !== op.id) return;
      if ((o.version ?? 0) < (last.version ?? 0)) return;
      last = o;
      onUpdate(o);
      if (ENDED.has(o.status)) finish();
    };
    const off = events.on("operation", apply);
    signal?.addEventListener("abort", finish);
    (async () => {
      while (!done) {
        try {
          const o = await api(`/v1/operations/${encodeURIComponent(op.id)}`, { query: { wait: "20s" }, signal: poll.signal });
          apply(o);
        } catch (e) {
          if (done || (e && e.name === "AbortError")) return;
          await new Promise((r) => setTimeout(r, 2000));
        }
      }
    })();
  });
}

export const KIND_VERB = {
  create: "Create",
  pause: "Pause",
  resume: "Resume",
  suspend: "Suspend",
  destroy: "Destroy",
  build: "Build",
};
