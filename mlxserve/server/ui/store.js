// Conversations, kept in the browser's localStorage (one JSON object, saved whole).
//
// A conversation: {id, title, titleSetByUser, model, system, params: {temperature, top_p,
// max_tokens}, tools, responseSchema, extra (other request fields, JSON), messages, created,
// updated}. A message:
// {role: "user" | "assistant", content: [parts]} where a part is {type: "text", text} --
// OpenAI's content parts, so an image part ({type: "image_url", image_url: {url}}) can
// join later without a new format. An assistant message also keeps reasoning,
// toolCalls, model, stats {completionTokens, promptTokens, cachedTokens, ttft, seconds}
// and finish ("stop", "length", "tool_calls", "stopped", "error") with error text.

const STORAGE = "mlxserve.conversations.v1";
const CURRENT = "mlxserve.currentConversation";

export function loadConversations() {
  try {
    const all = JSON.parse(localStorage.getItem(STORAGE) || "[]");
    return Array.isArray(all) ? all : [];
  } catch {
    return [];
  }
}

/** Save every conversation; false (and nothing lost in memory) when storage is full. */
export function saveConversations(conversations) {
  try {
    localStorage.setItem(STORAGE, JSON.stringify(conversations));
    return true;
  } catch {
    return false;
  }
}

export function currentId() {
  return localStorage.getItem(CURRENT);
}

export function setCurrentId(id) {
  localStorage.setItem(CURRENT, id);
}

export function newConversation(model) {
  const now = Date.now();
  return {
    id: crypto.randomUUID ? crypto.randomUUID() : `${now}-${Math.random()}`,
    title: "New chat",
    titleSetByUser: false,
    model,
    system: "",
    params: { temperature: null, top_p: null, max_tokens: null },
    tools: "",
    responseSchema: "",
    extra: "",
    messages: [],
    created: now,
    updated: now,
  };
}

export function textOf(message) {
  return message.content
    .filter((p) => p.type === "text")
    .map((p) => p.text)
    .join("");
}

export function textMessage(role, text) {
  return { role, content: [{ type: "text", text }] };
}

/** A message as the API takes it: a plain string when it is only text, else its parts. */
export function toApiMessage(message) {
  const onlyText = message.content.every((p) => p.type === "text");
  const out = { role: message.role, content: onlyText ? textOf(message) : message.content };
  if (message.role === "assistant" && message.toolCalls?.length && !out.content) {
    // No tool results follow in this page's conversations, so the calls go back as text.
    out.content = JSON.stringify(
      message.toolCalls.map((c) => ({ name: c.name, arguments: c.arguments })),
    );
  }
  return out;
}
