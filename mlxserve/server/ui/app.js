// The chat page: conversations in localStorage, answers streamed from
// /v1/chat/completions and drawn at most once per animation frame.

import { APIError, forgetKey, listModels, setKeyPrompt, storedKey, streamChat } from "./api.js";
import { IncrementalMarkdown, renderCode } from "./markdown.js";
import {
  currentId,
  loadConversations,
  newConversation,
  saveConversations,
  setCurrentId,
  textMessage,
  textOf,
  toApiMessage,
} from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  sidebar: $("sidebar"),
  list: $("conversation-list"),
  title: $("conversation-title"),
  titleInput: $("title-input"),
  model: $("model-select"),
  settings: $("settings"),
  settingsButton: $("settings-button"),
  settingsError: $("settings-error"),
  system: $("system-prompt"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  tools: $("tools"),
  schema: $("response-schema"),
  extra: $("extra-fields"),
  messages: $("messages"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  status: $("status"),
  theme: $("theme-toggle"),
  keyDialog: $("key-dialog"),
  keyInput: $("key-input"),
  keyReason: $("key-reason"),
  forgetKey: $("forget-key"),
};

let conversations = loadConversations();
let conversation = null; // the one shown; joins `conversations` with its first message
let models = [];
let generation = null; // the answer being streamed: {conversation, message, controller, view, ...}

// ------------------------------------------------------------------ conversations
function persist() {
  conversation.updated = Date.now();
  if (!conversations.includes(conversation)) conversations.push(conversation);
  if (!saveConversations(conversations)) {
    setStatus("The browser's storage is full: export and delete old conversations.");
  }
  renderSidebar();
}

function show(target) {
  if (generation && generation.conversation !== target) generation.view = null;
  conversation = target;
  setCurrentId(target.id);
  renderSidebar();
  renderHeader();
  renderSettings();
  renderMessages();
}

function startNewConversation() {
  if (conversation && conversation.messages.length === 0) return show(conversation);
  show(newConversation(models[0] || ""));
}

function renderSidebar() {
  const items = [...conversations].sort((a, b) => b.updated - a.updated);
  ui.list.replaceChildren(
    ...items.map((c) => {
      const li = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = c.title;
      button.title = c.title;
      button.dataset.id = c.id;
      if (c === conversation) button.setAttribute("aria-current", "true");
      button.addEventListener("click", () => show(c));
      li.append(button);
      return li;
    }),
  );
  ui.forgetKey.hidden = !storedKey();
}

function renderHeader() {
  ui.title.textContent = conversation.title;
  document.title = `${conversation.title} - mlxserve`;
  if (models.length) ui.model.value = modelOf(conversation);
}

function modelOf(conv) {
  return models.includes(conv.model) ? conv.model : models[0] || conv.model;
}

function renameConversation() {
  ui.title.hidden = true;
  ui.titleInput.hidden = false;
  ui.titleInput.value = conversation.title;
  ui.titleInput.focus();
  ui.titleInput.select();
}

function finishRename(save) {
  if (ui.titleInput.hidden) return;
  const title = ui.titleInput.value.trim();
  ui.titleInput.hidden = true;
  ui.title.hidden = false;
  if (save && title) {
    conversation.title = title;
    conversation.titleSetByUser = true;
    persist();
    renderHeader();
  }
  $("rename").focus();
}

function deleteConversation() {
  if (!confirm(`Delete the conversation "${conversation.title}"?`)) return;
  if (generation?.conversation === conversation) stopGeneration();
  conversations = conversations.filter((c) => c !== conversation);
  saveConversations(conversations);
  const next = [...conversations].sort((a, b) => b.updated - a.updated)[0];
  show(next || newConversation(models[0] || ""));
}

function download(name, value) {
  const url = URL.createObjectURL(
    new Blob([JSON.stringify(value, null, 2)], { type: "application/json" }),
  );
  const a = document.createElement("a");
  a.href = url;
  a.download = `${name.replace(/[^\w.-]+/g, "_").slice(0, 60) || "conversation"}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// ------------------------------------------------------------------ settings
function renderSettings() {
  const p = conversation.params;
  ui.system.value = conversation.system;
  ui.temperature.value = p.temperature ?? "";
  ui.topP.value = p.top_p ?? "";
  ui.maxTokens.value = p.max_tokens ?? "";
  ui.tools.value = conversation.tools;
  ui.schema.value = conversation.responseSchema;
  ui.extra.value = conversation.extra ?? "";
  ui.settingsError.textContent = "";
}

function readSettings() {
  const number = (input) => (input.value === "" ? null : Number(input.value));
  conversation.system = ui.system.value;
  conversation.params = {
    temperature: number(ui.temperature),
    top_p: number(ui.topP),
    max_tokens: number(ui.maxTokens),
  };
  conversation.tools = ui.tools.value;
  conversation.responseSchema = ui.schema.value;
  conversation.extra = ui.extra.value;
  try {
    advancedFields(conversation);
    ui.settingsError.textContent = "";
  } catch (e) {
    ui.settingsError.textContent = e.message;
  }
  persist();
}

/** The request fields of the Tools, Answer schema and Other fields boxes (throws naming
 * the bad box). */
function advancedFields(conv) {
  const out = {};
  const parse = (text, name) => {
    try {
      return JSON.parse(text);
    } catch (e) {
      throw new Error(`${name} is not valid JSON: ${e.message}`);
    }
  };
  if (conv.tools.trim()) {
    const tools = parse(conv.tools, "Tools");
    if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array");
    out.tools = tools;
  }
  if (conv.responseSchema.trim()) {
    const schema = parse(conv.responseSchema, "Answer schema");
    out.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  }
  if (conv.extra?.trim()) {
    const extra = parse(conv.extra, "Other request fields");
    if (!extra || typeof extra !== "object" || Array.isArray(extra)) {
      throw new Error("Other request fields must be a JSON object");
    }
    Object.assign(out, extra);
  }
  return out;
}

// ------------------------------------------------------------------ messages
function renderMessages() {
  if (conversation.messages.length === 0) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Ask anything. Enter sends, Shift+Enter starts a new line.";
    ui.messages.replaceChildren(empty);
    return;
  }
  const last = conversation.messages.length - 1;
  ui.messages.replaceChildren(
    ...conversation.messages.map((m, i) => {
      if (m.role === "user") return userView(m, i);
      const view = assistantView(m, i === last);
      if (generation?.message === m) {
        generation.view = view;
        schedule(generation);
      } else {
        drawAnswer(m, view);
      }
      return view.article;
    }),
  );
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function element(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function actionButton(label, onClick, accessibleName) {
  const b = element("button", "", label);
  b.type = "button";
  if (accessibleName) b.setAttribute("aria-label", accessibleName);
  b.addEventListener("click", onClick);
  return b;
}

function userView(message, index) {
  const article = element("article", "msg user");
  article.setAttribute("aria-label", "You");
  const body = element("div", "body", textOf(message));
  const actions = element("div", "msg-actions");
  actions.append(
    actionButton("Edit", () => editMessage(article, index), "Edit this message and resend"),
  );
  article.append(element("div", "who", "You"), body, actions);
  return article;
}

function editMessage(article, index) {
  if (generation) return;
  const message = conversation.messages[index];
  const box = element("div", "edit-box");
  const input = element("textarea");
  input.value = textOf(message);
  input.setAttribute("aria-label", "Edited message");
  const save = actionButton("Save and send", () => {
    if (!input.value.trim()) return;
    message.content = [{ type: "text", text: input.value }];
    conversation.messages.splice(index + 1); // the answers after it no longer follow from it
    answer();
  });
  save.className = "primary";
  const buttons = element("div", "msg-actions");
  buttons.append(save, actionButton("Cancel", () => renderMessages()));
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      save.click();
    } else if (e.key === "Escape") renderMessages();
  });
  box.append(input, buttons);
  article.querySelector(".msg-actions").remove();
  article.querySelector(".body").replaceWith(box);
  input.focus();
}

function assistantView(message, isLast) {
  const article = element("article", "msg assistant");
  article.setAttribute("aria-label", "Answer");
  const who = element("div", "who", message.model || "");
  const reasoning = element("details", "reasoning");
  const reasoningText = document.createTextNode("");
  const reasoningBody = element("div");
  reasoningBody.append(reasoningText);
  reasoning.append(element("summary", "", "Reasoning"), reasoningBody);
  reasoning.hidden = true;
  const body = element("div", "body");
  const toolCalls = element("div", "tool-calls");
  const finish = element("p", "finish");
  finish.hidden = true;
  const stats = element("div", "stats");
  const actions = element("div", "msg-actions");
  actions.append(actionButton("Copy", () => copyText(textOf(message)), "Copy the answer"));
  if (isLast) {
    actions.append(actionButton("Regenerate", regenerate, "Regenerate this answer"));
  }
  article.append(who, reasoning, body, toolCalls, finish, stats, actions);
  const markdown = message.structured ? null : new IncrementalMarkdown(body);
  return { article, who, reasoning, reasoningText, body, markdown, toolCalls, finish, stats };
}

/** Bring an answer's view up to date with its message (cheap to repeat while streaming). */
function drawAnswer(message, view) {
  view.article.dataset.state = message.finish || "streaming";
  view.who.textContent = message.model || "";
  if (message.reasoning) {
    view.reasoning.hidden = false;
    const more = message.reasoning.slice(view.reasoningText.length);
    if (more) view.reasoningText.appendData(more);
  }
  const text = textOf(message);
  if (view.markdown) {
    view.markdown.update(text);
  } else {
    view.body.innerHTML = renderCode(message.finish ? prettyJson(text) : text, "json");
  }
  if (message.toolCalls?.length) drawToolCalls(message.toolCalls, view.toolCalls);
  const finish = finishText(message);
  view.finish.hidden = !finish;
  view.finish.textContent = finish;
  view.finish.classList.toggle("error", message.finish === "error");
  view.stats.textContent = statsText(message);
}

function drawToolCalls(calls, container) {
  container.replaceChildren(
    ...calls.map((call) => {
      const box = element("div", "tool-call");
      box.append(element("strong", "", `Tool call: ${call.name || "…"}`));
      box.append(element("pre", "", prettyJson(call.arguments)));
      return box;
    }),
  );
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function finishText(message) {
  switch (message.finish) {
    case "length":
      return "Stopped at the max tokens limit.";
    case "stopped":
      return "Stopped.";
    case "error":
      return `Error: ${message.error}`;
    case "abort":
      return "Aborted by the server.";
    default:
      return "";
  }
}

function statsText(message) {
  const s = message.stats;
  if (!s) return "";
  const parts = [`${s.completionTokens}${s.approximate ? "+" : ""} tokens`];
  if (s.completionTokens > 1 && s.seconds > 0) {
    parts.push(`${((s.completionTokens - 1) / s.seconds).toFixed(1)} tok/s`);
  }
  if (s.ttft != null) parts.push(`TTFT ${s.ttft.toFixed(2)} s`);
  if (s.promptTokens != null) {
    parts.push(`${s.cachedTokens ?? 0} of ${s.promptTokens} prompt tokens cached`);
  }
  return parts.join(" · ");
}

// ------------------------------------------------------------------ generation
function send(text) {
  if (generation || !text.trim()) return;
  conversation.messages.push(textMessage("user", text));
  if (!conversation.titleSetByUser && conversation.messages.length === 1) {
    conversation.title = text.trim().replace(/\s+/g, " ").slice(0, 48);
  }
  ui.prompt.value = "";
  fitPrompt();
  answer();
}

function regenerate() {
  if (generation) return;
  const last = conversation.messages.at(-1);
  if (last?.role === "assistant") conversation.messages.pop();
  answer();
}

/** Stream an answer to the conversation's messages (they end with the user's turn). */
async function answer() {
  const conv = conversation;
  let extra;
  try {
    extra = advancedFields(conv);
  } catch (e) {
    setStatus(e.message);
    renderMessages();
    return;
  }
  const model = modelOf(conv);
  const history = conv.messages.map(toApiMessage);
  if (conv.system.trim()) history.unshift({ role: "system", content: conv.system });
  const message = { ...textMessage("assistant", ""), model, structured: !!extra.response_format };
  conv.messages.push(message);
  const body = { model, messages: history, ...extra };
  for (const [name, value] of Object.entries(conv.params)) if (value != null) body[name] = value;

  generation = { conversation: conv, message, controller: new AbortController(), chunks: 0 };
  const gen = generation;
  persist();
  renderHeader();
  renderMessages();
  setGenerating(true);
  setStatus("");
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  try {
    for await (const chunk of streamChat(body, gen.controller.signal)) {
      if (chunk.model) message.model = chunk.model;
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content || delta.tool_calls?.length) {
        firstToken ??= performance.now();
        gen.chunks++;
      }
      if (delta.content) message.content[0].text += delta.content;
      if (delta.reasoning_content) message.reasoning = (message.reasoning || "") + delta.reasoning_content;
      for (const call of delta.tool_calls || []) addToolCall(message, call);
      if (choice.finish_reason) message.finish = choice.finish_reason;
      schedule(gen);
    }
    message.finish ||= "stop";
  } catch (e) {
    if (gen.controller.signal.aborted) {
      message.finish = "stopped";
    } else {
      message.finish = "error";
      message.error = e instanceof APIError || e instanceof Error ? e.message : String(e);
    }
  }
  const ended = performance.now();
  message.stats = {
    completionTokens: usage ? usage.completion_tokens : gen.chunks,
    approximate: !usage,
    promptTokens: usage ? usage.prompt_tokens : null,
    cachedTokens: usage?.prompt_tokens_details?.cached_tokens ?? null,
    ttft: firstToken == null ? null : (firstToken - started) / 1000,
    seconds: firstToken == null ? 0 : (ended - firstToken) / 1000,
  };
  generation = null;
  setGenerating(false);
  if (gen.view) drawAnswer(message, gen.view);
  conv.updated = Date.now();
  if (conversation === conv) persist();
  else saveConversations(conversations);
}

function addToolCall(message, delta) {
  message.toolCalls ||= [];
  const call = (message.toolCalls[delta.index ?? message.toolCalls.length] ||= {
    id: "",
    name: "",
    arguments: "",
  });
  if (delta.id) call.id = delta.id;
  if (delta.function?.name) call.name += delta.function.name;
  if (delta.function?.arguments) call.arguments += delta.function.arguments;
}

// Streamed tokens only change the message object; the page is redrawn at most once per
// frame, and less often when a redraw is slow, so a long answer never blocks input.
function schedule(gen) {
  if (gen.scheduled || !gen.view) return;
  gen.scheduled = true;
  const delay = gen.cost > 8 ? gen.cost * 3 : 0;
  const draw = () =>
    requestAnimationFrame(() => {
      gen.scheduled = false;
      if (!gen.view) return;
      const stick = isNearBottom();
      const t = performance.now();
      drawAnswer(gen.message, gen.view);
      gen.cost = performance.now() - t;
      if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
    });
  if (delay) setTimeout(draw, delay);
  else draw();
}

function isNearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 60;
}

function stopGeneration() {
  generation?.controller.abort();
}

function setGenerating(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  ui.messages.setAttribute("aria-busy", on ? "true" : "false");
  if (!on && document.activeElement === document.body) ui.prompt.focus();
}

// ------------------------------------------------------------------ small helpers
function setStatus(text) {
  ui.status.textContent = text;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // No clipboard API outside a secure context (a LAN address over http): the old way.
    const area = element("textarea");
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

function fitPrompt() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${ui.prompt.scrollHeight + 2}px`;
}

const THEMES = ["system", "light", "dark"];

function applyTheme(theme) {
  if (theme === "system") {
    delete document.documentElement.dataset.theme;
    localStorage.removeItem("mlxserve.theme");
  } else {
    document.documentElement.dataset.theme = theme;
    localStorage.setItem("mlxserve.theme", theme);
  }
  ui.theme.textContent = `Theme: ${theme}`;
}

let keyRequest = null; // one dialog for all the requests that met a 401 at once

function promptForKey(reason) {
  keyRequest ||= new Promise((resolve, reject) => {
    ui.keyReason.textContent = reason;
    ui.keyInput.value = "";
    ui.keyDialog.addEventListener(
      "close",
      () => {
        keyRequest = null;
        const key = ui.keyInput.value.trim();
        if (ui.keyDialog.returnValue === "ok" && key) {
          resolve(key);
          ui.forgetKey.hidden = false;
        } else {
          reject(new APIError(401, "this server needs an API key (reload the page to enter it)"));
        }
      },
      { once: true },
    );
    ui.keyDialog.returnValue = "";
    ui.keyDialog.showModal();
    ui.keyInput.focus();
  });
  return keyRequest;
}

// ------------------------------------------------------------------ wiring
async function loadModels() {
  setStatus("Loading the model list…");
  try {
    models = await listModels();
    setStatus("");
  } catch (e) {
    setStatus(`Could not list the models: ${e.message}`);
    return;
  }
  ui.model.replaceChildren(
    ...models.map((name) => {
      const option = element("option", "", name);
      option.value = name;
      return option;
    }),
  );
  if (!conversation.model) conversation.model = models[0];
  renderHeader();
}

function wire() {
  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    send(ui.prompt.value);
  });
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send(ui.prompt.value);
    }
  });
  ui.prompt.addEventListener("input", fitPrompt);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && generation && !ui.keyDialog.open) stopGeneration();
  });
  ui.stop.addEventListener("click", () => {
    stopGeneration();
    ui.prompt.focus();
  });
  $("new-chat").addEventListener("click", () => {
    startNewConversation();
    ui.prompt.focus();
  });
  $("rename").addEventListener("click", renameConversation);
  ui.titleInput.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finishRename(true);
    else if (e.key === "Escape") finishRename(false);
  });
  ui.titleInput.addEventListener("blur", () => finishRename(true));
  $("delete").addEventListener("click", deleteConversation);
  $("export").addEventListener("click", () => download(conversation.title, conversation));
  $("export-all").addEventListener("click", () =>
    download("mlxserve-conversations", conversations),
  );
  ui.model.addEventListener("change", () => {
    conversation.model = ui.model.value;
    if (conversation.messages.length) persist();
  });
  ui.settingsButton.addEventListener("click", () => {
    const open = ui.settings.hidden;
    ui.settings.hidden = !open;
    ui.settingsButton.setAttribute("aria-expanded", String(open));
    if (open) ui.system.focus();
  });
  const fields = [ui.system, ui.temperature, ui.topP, ui.maxTokens, ui.tools, ui.schema, ui.extra];
  for (const input of fields) {
    input.addEventListener("change", readSettings);
  }
  $("toggle-sidebar").addEventListener("click", (e) => {
    const hidden = ui.sidebar.classList.toggle("collapsed");
    e.currentTarget.setAttribute("aria-expanded", String(!hidden));
  });
  ui.theme.addEventListener("click", () => {
    const now = document.documentElement.dataset.theme || "system";
    applyTheme(THEMES[(THEMES.indexOf(now) + 1) % THEMES.length]);
  });
  ui.forgetKey.addEventListener("click", () => {
    forgetKey();
    ui.forgetKey.hidden = true;
    setStatus("The API key is forgotten.");
  });
  $("key-cancel").addEventListener("click", () => ui.keyDialog.close("cancel"));
  ui.messages.addEventListener("click", async (e) => {
    const button = e.target.closest(".copy-code");
    if (!button) return;
    const code = button.closest(".code-block").querySelector("code").textContent;
    button.textContent = (await copyText(code)) ? "Copied" : "Copy failed";
    setTimeout(() => {
      button.textContent = "Copy";
    }, 1500);
  });
}

function main() {
  setKeyPrompt(promptForKey);
  applyTheme(document.documentElement.dataset.theme || "system");
  wire();
  const saved = conversations.find((c) => c.id === currentId());
  show(saved || newConversation(""));
  loadModels();
  ui.prompt.focus();
}

main();
