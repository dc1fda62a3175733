// Merging sandbox objects from the list, single reads and events.
//
// Events carry the sandbox as stored, whose `cost` is not filled in (the server measures
// cost when the sandbox is read), so an event must not wipe a cost a read has shown: it
// keeps the known cost while the state stays the same, and the page reads the sandbox
// again shortly after to get the cost of a new state.

function costKnown(c) {
  return !!c && [c.memory_bytes, c.snapshot_bytes, c.disk_bytes].some((v) => v !== null && v !== undefined);
}

/** The object to keep, given the one held (or undefined) and a new one; null: keep `have`. */
export function mergeSandbox(have, incoming) {
  if (!have) return incoming;
  const hv = have.version ?? 0;
  const iv = incoming.version ?? 0;
  if (iv < hv) return null;
  if (!costKnown(incoming.cost) && costKnown(have.cost) && have.state === incoming.state) {
    return { ...incoming, cost: have.cost };
  }
  return incoming;
}

export { costKnown };
