// afm's chat page: the server's own OpenAI API, called from the browser.
//
// GET v1/models fills the model picker; POST v1/chat/completions with
// stream: true is read with fetch + a ReadableStream SSE parser, following
// the streaming contract: content and reasoning_content appended as separate
// channels (reasoning in a folded <details>), tool_calls merged by index as
// their argument fragments arrive, the finish chunk, usage, the
// {"afm_profile": {...}} event (asked for with X-AFM-Profile: true), then
// [DONE].  Stop POSTs v1/chat/completions/{X-Request-ID}/cancel with the id
// this page made and sent; the stream then ends with finish_reason
// "cancelled".  Errors are shown as they come: the HTTP error envelope before
// a stream starts, an {"error": {...}} chunk after.  Model output only ever
// reaches the page as text nodes (textContent, append), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "afm.apiKey";

const state = {
  messages: [], // the conversation sent with each request
  busy: null,   // the reply being streamed: {rid, controller, reply, stopping}
};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function headers(extra) {
  const result = {"Content-Type": "application/json", ...extra};
  const key = $("api-key").value.trim();
  if (key) result.Authorization = "Bearer " + key;
  return result;
}

function showBanner(text) {
  $("banner").textContent = text;
  $("banner").hidden = !text;
}

// "HTTP 401: missing or invalid API key (invalid_api_key)" from an error envelope.
async function httpError(response) {
  let detail = response.statusText;
  try {
    const body = await response.json();
    const error = body.error || {};
    detail = error.message || JSON.stringify(body);
    if (error.code) detail += " (" + error.code + ")";
  } catch (_) { /* not JSON: keep the status text */ }
  return "HTTP " + response.status + ": " + detail;
}

function requestId() {
  const bytes = new Uint8Array(12);
  crypto.getRandomValues(bytes);
  return "ui-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function loadModels() {
  let response;
  try {
    response = await fetch("v1/models", {headers: headers()});
  } catch (err) {
    showBanner("Cannot reach the server: " + err.message);
    return;
  }
  if (!response.ok) {
    const hint = response.status === 401 ? " Enter the API key above." : "";
    showBanner(await httpError(response) + hint);
    return;
  }
  showBanner("");
  const select = $("model");
  const previous = select.value;
  const ids = (await response.json()).data.map((m) => m.id);
  select.replaceChildren(...ids.map((id) => {
    const option = el("option", "", id);
    option.value = id;
    return option;
  }));
  if (ids.includes(previous)) select.value = previous;
}

// The data of each server-sent event in `body` (a ReadableStream of bytes);
// comments (": keepalive") and other fields are skipped.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  let skipLF = false; // a chunk ended on "\r": its "\n" may start the next one
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      let text = value;
      if (skipLF && text.startsWith("\n")) text = text.slice(1);
      skipLF = text.endsWith("\r");
      const lines = (buffer + text).split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// One assistant reply on the page and what it has received.
class Reply {
  constructor() {
    this.node = el("article", "msg assistant");
    this.node.dataset.state = "waiting";
    this.reasoning = el("details", "reasoning");
    this.reasoning.hidden = true;
    this.reasoning.append(el("summary", "", "Reasoning"));
    this.reasoningText = el("div", "reasoning-text");
    this.reasoning.append(this.reasoningText);
    this.content = el("div", "content");
    this.tools = el("div", "tool-calls");
    this.status = el("div", "status", "waiting…");
    this.node.append(el("div", "role", "assistant"), this.reasoning, this.content, this.tools,
                     this.status);
    this.text = "";
    this.calls = new Map(); // tool_calls[].index -> {id, type, name, args, nodes}
    this.finishReason = null;
    this.usage = null;
    this.errors = [];
  }

  addReasoning(text) {
    this.reasoning.hidden = false;
    this.reasoningText.append(text);
  }

  addContent(text) {
    this.text += text;
    this.content.append(text);
  }

  // Keep the first id, type and name of each index; append every arguments fragment.
  addToolCall(fragment) {
    let call = this.calls.get(fragment.index);
    if (!call) {
      call = {id: null, type: null, name: "", args: "",
              node: el("div", "tool-call"), nameNode: el("span", "tool-name"),
              argsNode: el("code", "tool-args")};
      call.node.dataset.index = String(fragment.index);
      call.node.append("tool call ", call.nameNode, "(", call.argsNode, ")");
      this.tools.append(call.node);
      this.calls.set(fragment.index, call);
    }
    const fn = fragment.function || {};
    call.id = call.id || fragment.id || null;
    call.type = call.type || fragment.type || null;
    if (fn.name && !call.name) {
      call.name = fn.name;
      call.nameNode.textContent = fn.name;
    }
    if (fn.arguments) {
      call.args += fn.arguments;
      call.argsNode.append(fn.arguments);
    }
  }

  finish(reason) {
    this.finishReason = reason;
    for (const call of this.calls.values()) { // complete now: parse
      try {
        JSON.parse(call.args || "{}");
      } catch (_) {
        call.node.classList.add("invalid");
        call.node.title = "arguments are not valid JSON";
      }
    }
    this.render();
  }

  fail(message) {
    this.errors.push(message);
    this.render();
  }

  setState(value) {
    this.node.dataset.state = value;
    this.render();
  }

  note(text) {
    this.status.textContent = text;
  }

  render() {
    const parts = [];
    if (this.finishReason) parts.push(this.finishReason === "cancelled" ? "cancelled"
                                      : "finished: " + this.finishReason);
    if (this.usage) {
      parts.push(this.usage.prompt_tokens + " prompt + " + this.usage.completion_tokens
                 + " completion tokens");
    }
    for (const error of this.errors) parts.push("error: " + error);
    if (!parts.length) parts.push(this.node.dataset.state === "streaming" ? "streaming…" : "waiting…");
    this.status.textContent = parts.join(" · ");
    this.node.dataset.finish = this.finishReason || "";
    this.node.classList.toggle("cancelled", this.finishReason === "cancelled");
    this.node.classList.toggle("error", this.errors.length > 0);
  }

  // The assistant message to send back with the next turn (null if nothing came).
  message() {
    const calls = [...this.calls.entries()].sort((a, b) => a[0] - b[0]).map(([, c]) => ({
      id: c.id, type: c.type || "function", function: {name: c.name, arguments: c.args}}));
    if (!this.text && !calls.length) return null;
    const message = {role: "assistant", content: this.text};
    if (calls.length) message.tool_calls = calls;
    return message;
  }
}

// The conversation follows the stream while scrolled to its end; scrolling up stops that.
let stickToEnd = true;

function scrollDown(force) {
  const c = $("conversation");
  if (force) stickToEnd = true;
  if (stickToEnd) c.scrollTop = c.scrollHeight;
}

function addMessage(node) {
  $("conversation").append(node);
  scrollDown(true);
}

function showProfile(profile) {
  const list = $("profile");
  list.replaceChildren();
  for (const [key, value] of Object.entries(profile)) {
    if (value !== null && typeof value === "object") continue;
    const entry = el("div");
    entry.append(el("dt", "", key), el("dd", "", String(value)));
    list.append(entry);
  }
  $("profile-panel").hidden = false;
}

async function readStream(body, reply) {
  for await (const data of sseData(body)) {
    if (data === "[DONE]") return true;
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch (_) {
      reply.fail("unreadable event: " + data.slice(0, 200));
      continue;
    }
    if (chunk.afm_profile) { showProfile(chunk.afm_profile); continue; }
    if (chunk.afm_profile_extended) { showProfile(chunk.afm_profile_extended.summary || {}); continue; }
    if (chunk.error) { // a generation error after the stream began
      const e = chunk.error;
      reply.fail((e.message || JSON.stringify(e)) + (e.code ? " (" + e.code + ")" : ""));
      continue;
    }
    if (chunk.usage) reply.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) reply.addReasoning(delta.reasoning_content);
      if (delta.content) reply.addContent(delta.content);
      for (const fragment of delta.tool_calls || []) reply.addToolCall(fragment);
      if (choice.finish_reason) reply.finish(choice.finish_reason);
    }
    reply.render();
    scrollDown();
  }
  return false;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("clear").disabled = busy;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.busy) return;
  let tools = null;
  const toolsText = $("tools").value.trim();
  if (toolsText) {
    try {
      tools = JSON.parse(toolsText);
    } catch (err) {
      showBanner("Tools are not valid JSON: " + err.message);
      return;
    }
  }
  showBanner("");
  $("prompt").value = "";
  const user = el("article", "msg user");
  user.append(el("div", "role", "user"), el("div", "content", text));
  addMessage(user);
  state.messages.push({role: "user", content: text});

  const body = {messages: [...state.messages], stream: true, stream_options: {include_usage: true}};
  const system = $("system").value.trim();
  if (system) body.messages.unshift({role: "system", content: system});
  if ($("model").value) body.model = $("model").value;
  if (tools) body.tools = tools;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;

  $("profile-panel").hidden = true;
  const reply = new Reply();
  addMessage(reply.node);
  const busy = {rid: requestId(), controller: new AbortController(), reply, stopping: false};
  reply.node.dataset.requestId = busy.rid;
  state.busy = busy;
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers({"X-Request-ID": busy.rid, "X-AFM-Profile": "true"}),
      body: JSON.stringify(body),
      signal: busy.controller.signal,
    });
    if (!response.ok) {
      reply.fail(await httpError(response));
      // nothing was generated: take the message back so it can be sent again
      state.messages.pop();
      if (!$("prompt").value) $("prompt").value = text;
    } else {
      reply.setState("streaming");
      if (!await readStream(response.body, reply)) reply.fail("the stream ended without [DONE]");
    }
  } catch (err) {
    reply.fail(busy.controller.signal.aborted ? "stopped: connection closed"
                                              : "network error: " + err.message);
  } finally {
    state.busy = null;
    setBusy(false);
    reply.setState(reply.errors.length ? "error" : "done");
    const message = reply.message();
    if (message) state.messages.push(message);
    scrollDown();
  }
}

// Cancel by the X-Request-ID this page sent; the stream then ends "cancelled".
async function stop() {
  const busy = state.busy;
  if (!busy || busy.stopping) return;
  busy.stopping = true;
  $("stop").disabled = true;
  busy.reply.note("stopping…");
  let response = null;
  try {
    response = await fetch("v1/chat/completions/" + encodeURIComponent(busy.rid) + "/cancel",
                           {method: "POST", headers: headers()});
  } catch (_) { /* below: stop reading instead */ }
  if (response && response.ok) return;
  if (response && response.status === 404) {
    // not running (yet, or any more): if the stream has not ended soon, stop reading it
    setTimeout(() => { if (state.busy === busy) busy.controller.abort(); }, 1000);
    return;
  }
  if (response) busy.reply.fail("cancel failed: " + await httpError(response));
  busy.controller.abort(); // the connection's end drops the request too
}

function newChat() {
  if (state.busy) return;
  state.messages = [];
  $("conversation").replaceChildren();
  $("profile-panel").hidden = true;
  showBanner("");
}

function storeKey() {
  try {
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
  } catch (_) { /* storage unavailable: the key lasts until the page is left */ }
  loadModels();
}

function start() {
  try {
    $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  } catch (_) { /* storage unavailable */ }
  $("api-key").addEventListener("change", storeKey);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("conversation").addEventListener("scroll", () => {
    const c = $("conversation");
    stickToEnd = c.scrollHeight - c.scrollTop - c.clientHeight < 40;
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", newChat);
  loadModels();
  $("prompt").focus();
}

start();
