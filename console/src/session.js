// Who is signed in, from `GET /v1/whoami`: the key's tenant, and whether it is the
// server's own token (the operator, who alone manages pools).

import { api } from "./api.js";

let me = null; // { tenant, key_id, operator }
const listeners = new Set();

function set(next) {
  me = next;
  for (const fn of listeners) fn(me);
}

export const session = {
  tenant: () => (me ? me.tenant : null),
  operator: () => Boolean(me && me.operator),
  /** Calls `fn(me)` now and on every change; returns the unsubscribe. */
  onChange(fn) {
    listeners.add(fn);
    fn(me);
    return () => listeners.delete(fn);
  },
  /** Takes the login check's answer. */
  seed(whoami) {
    set(whoami);
  },
  async discover() {
    if (me) return;
    try {
      set(await api("/v1/whoami"));
    } catch {
      /* not important enough to show: the header just names no tenant */
    }
  },
  reset() {
    set(null);
  },
};
