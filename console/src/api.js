// The /v1 client. The key lives in sessionStorage only (this browser tab's session):
// never in localStorage, never in a URL. Every request sends it as a bearer token.

const KEY = "space.console.key";

export function getKey() {
  try {
    return sessionStorage.getItem(KEY);
  } catch {
    return null;
  }
}

export function setKey(key) {
  sessionStorage.setItem(KEY, key);
}

export function clearKey() {
  try {
    sessionStorage.removeItem(KEY);
  } catch {
    /* storage unavailable: nothing kept */
  }
}

/** An error answer of the API (`{"error":{"code","message"}}`) or a failed request. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let unauthorized = () => {};
/** Called (once per 401) when the server stops accepting the session's key. */
export function onUnauthorized(fn) {
  unauthorized = fn;
}

/** Builds `/v1/...?a=b` from a path and a query object (undefined/null/"" values dropped). */
export function url(path, query) {
  const u = new URL(path, location.origin);
  if (query) {
    for (const [k, v] of Object.entries(query)) {
      if (v !== undefined && v !== null && v !== "") u.searchParams.set(k, String(v));
    }
  }
  return u.pathname + u.search;
}

/**
 * Sends a request. Options: method, query, json (a body sent as JSON), body (raw),
 * signal, key (a key other than the session's, for the login check), raw (return the
 * Response itself, for streams and downloads). Resolves to the parsed JSON (or null for
 * an empty answer); rejects with an ApiError.
 */
export async function api(path, opts = {}) {
  const key = opts.key ?? getKey();
  const headers = new Headers(opts.headers || {});
  if (key) headers.set("Authorization", "Bearer " + key);
  let body = opts.body;
  if (opts.json !== undefined) {
    headers.set("Content-Type", "application/json");
    body = JSON.stringify(opts.json);
  }
  let resp;
  try {
    resp = await fetch(url(path, opts.query), {
      method: opts.method || "GET",
      headers,
      body,
      signal: opts.signal,
      cache: "no-store",
      credentials: "omit",
    });
  } catch (e) {
    if (e && e.name === "AbortError") throw e;
    throw new ApiError(0, "network", "Could not reach the server (" + (e && e.message ? e.message : "network error") + ")");
  }
  if (!resp.ok) {
    const err = await errorOf(resp);
    if (resp.status === 401 && opts.key === undefined && key && key === getKey()) unauthorized(err);
    throw err;
  }
  if (opts.raw) return resp;
  const text = await resp.text();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

async function errorOf(resp) {
  let code = "http_" + resp.status;
  let message = resp.statusText || "request failed";
  try {
    const text = await resp.text();
    try {
      const j = JSON.parse(text);
      if (j && j.error) {
        code = j.error.code || code;
        message = j.error.message || message;
      }
    } catch {
      if (text) message = text.slice(0, 300);
    }
  } catch {
    /* body unreadable */
  }
  return new ApiError(resp.status, code, message);
}

/** A human sentence for an error, with the status for context. */
export function describe(err) {
  if (!err) return "Unknown error";
  if (err instanceof ApiError) {
    if (err.status === 0) return err.message;
    return `${err.message} (${err.status} ${err.code})`;
  }
  return String(err.message || err);
}

/**
 * Reads a streamed body line by line (NDJSON, or text logs), calling onLine for each
 * complete line and onText for raw text as it arrives (either may be omitted).
 */
export async function readLines(resp, onLine, signal) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  const abort = () => reader.cancel().catch(() => {});
  signal?.addEventListener("abort", abort);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i);
        buf = buf.slice(i + 1);
        onLine(line);
      }
    }
    buf += dec.decode();
    if (buf) onLine(buf);
  } finally {
    signal?.removeEventListener("abort", abort);
  }
}

/** base64url without padding of a string's UTF-8 bytes (the attach subprotocol's token). */
export function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let bin = "";
  for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** Bytes of a base64 string. */
export function fromBase64(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
