// The page's only way to the server: same-origin fetches with the API key (when one is
// kept) as a Bearer token, a prompt for the key on 401, and the SSE reader of a streamed
// chat completion.

const KEY_STORAGE = "mlxserve.apiKey";

export class APIError extends Error {
  constructor(status, message, param = null) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

let askForKey = async () => {
  throw new APIError(401, "this server needs an API key");
};

/** Set the function that asks the user for a key: (reason) => Promise<string> (rejects on cancel). */
export function setKeyPrompt(prompt) {
  askForKey = prompt;
}

export function storedKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function forgetKey() {
  localStorage.removeItem(KEY_STORAGE);
}

/** fetch() with the key; a 401 asks for a (new) key and tries again, until cancelled. */
export async function apiFetch(path, init = {}) {
  let refused = false;
  for (;;) {
    const headers = new Headers(init.headers || {});
    const key = storedKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    await response.body?.cancel();
    const reason = key && refused ? "The server refused that key." : "This server needs an API key.";
    refused = true;
    localStorage.setItem(KEY_STORAGE, await askForKey(reason));
  }
}

/** The error a non-2xx response carries (OpenAI's {"error": {...}} shape, or its text). */
export async function errorOf(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error && typeof error === "object") {
      return new APIError(response.status, error.message || text, error.param ?? null);
    }
    if (typeof error === "string") return new APIError(response.status, error);
  } catch {
    // not JSON: the text itself says what went wrong
  }
  return new APIError(response.status, text || response.statusText);
}

export async function listModels() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) throw await errorOf(response);
  return (await response.json()).data.map((m) => m.id);
}

/**
 * POST /v1/chat/completions with stream=true; yields each chunk (parsed JSON) until
 * [DONE]. Aborting `signal` closes the connection, which aborts the request on the server.
 */
export async function* streamChat(body, signal) {
  const response = await apiFetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      // JSON never holds a raw CR, so dropping them leaves "\n\n" between any two events.
      buffer += value.replace(/\r/g, "");
      let start = 0;
      let end;
      while ((end = buffer.indexOf("\n\n", start)) !== -1) {
        const event = buffer.slice(start, end);
        start = end + 2;
        const data = event
          .split("\n")
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          const e = chunk.error;
          throw new APIError(e.code || 500, e.message || JSON.stringify(e), e.param ?? null);
        }
        yield chunk;
      }
      buffer = buffer.slice(start);
    }
  } finally {
    reader.cancel().catch(() => {});
  }
  throw new APIError(0, "the stream ended without [DONE]");
}
