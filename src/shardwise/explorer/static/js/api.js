// Talking to the server: POST controls, the Server-Sent Events feed, JSON reads.

export async function post(action, body = {}) {
  // JSON content type on purpose: the server refuses anything else (see server.py).
  const res = await fetch(`/api/${action}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(data.error || `${action}: HTTP ${res.status}`);
  return data;
}

export async function getJSON(path) {
  const res = await fetch(path, { cache: "no-store" });
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
  return res.json();
}

// Calls onState(state) for every `state` message; EventSource reconnects by itself.
export function subscribe(onState, onStatus) {
  const source = new EventSource("/api/events");
  source.addEventListener("state", (ev) => onState(JSON.parse(ev.data)));
  source.addEventListener("open", () => onStatus("connected"));
  source.addEventListener("error", () => onStatus("reconnecting"));
  return source;
}
