// The chat page of `z2all serve`: plain JavaScript, no build step, no network beyond this server.
//
// Safety rule: text from the model or the user is only ever put into the page as text (textContent, text nodes),
// never parsed as HTML; fenced code blocks become <pre><code> elements whose content is set as text.
// State: the conversation is kept in memory only (a reload clears it); the API key, when the server wants one, is
// kept in sessionStorage (this tab only); the theme choice in localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "z2all-api-key";
const THEME_STORE = "z2all-theme";

const state = {
  model: null,        // the id the server serves (from /v1/models)
  context: null,      // its context length in tokens
  history: [],        // [{role, content}] of the current conversation (user and assistant turns)
  controller: null,   // the AbortController of the running request, null when idle
};

// ---------------------------------------------------------------------------------------------- rendering
// Text is split on ``` fences: the parts outside are paragraphs (white-space kept by CSS), the parts inside are
// code blocks with a copy button. An unclosed fence (a reply still streaming) is shown as code already.
function renderText(container, text) {
  const parts = text.split("```");
  const nodes = [];
  parts.forEach((part, i) => {
    if (i % 2 === 0) {
      if (part) {
        const p = document.createElement("div");
        p.className = "text";
        p.textContent = part;
        nodes.push(p);
      }
      return;
    }
    const newline = part.indexOf("\n");
    const lang = newline > 0 ? part.slice(0, newline).trim() : "";
    const code = newline >= 0 ? part.slice(newline + 1) : part;
    const block = document.createElement("div");
    block.className = "code-block";
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const label = document.createElement("span");
    label.textContent = /^[\w+#.-]{1,20}$/.test(lang) ? lang : "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "copy this code block");
    copy.addEventListener("click", () => copyText(code, copy));
    bar.append(label, copy);
    const pre = document.createElement("pre");
    const codeEl = document.createElement("code");
    codeEl.textContent = code;
    pre.append(codeEl);
    block.append(bar, pre);
    nodes.push(block);
  });
  container.replaceChildren(...nodes);
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (err) {  // no clipboard permission (e.g. plain http on another host): select the text for Ctrl+C
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

function addMessage(role, text) {
  const box = document.createElement("article");
  box.className = `message ${role}`;
  const who = document.createElement("h2");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  renderText(body, text);
  box.append(who, body);
  $("log").append(box);
  box.scrollIntoView({block: "end"});
  return body;
}

function showError(message) {
  const el = $("error");
  el.textContent = message || "";
  el.hidden = !message;
}

// ---------------------------------------------------------------------------------------------- the API
function headers() {
  const h = {"Content-Type": "application/json"};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// GET /v1/models; on 401 asks for the key (once per tab) and tries again.
async function connect() {
  for (;;) {
    let response;
    try {
      response = await fetch("/v1/models", {headers: headers()});
    } catch (err) {
      $("model-info").textContent = `server unreachable: ${err.message}`;
      return;
    }
    if (response.status === 401) {
      const hadKey = sessionStorage.getItem(KEY_STORE) !== null;
      sessionStorage.removeItem(KEY_STORE);
      await askKey(hadKey);
      continue;
    }
    const body = await response.json();
    if (!response.ok) {
      $("model-info").textContent = errorText(body, response.status);
      return;
    }
    const model = body.data[0];
    state.model = model.id;
    state.context = model.context_length || null;
    $("model-info").textContent = `${model.id}` + (state.context ? ` · context ${state.context} tokens` : "");
    // the most a reply can have: the server's limit and the context (the server cuts each request further, to
    // what the conversation leaves of the context: see requestBody)
    const most = Math.min(model.max_tokens_limit || Infinity, state.context || Infinity);
    if (Number.isFinite(most)) {
      $("max-tokens").max = most;
      if (+$("max-tokens").value > most) $("max-tokens").value = most;
    }
    return;
  }
}

function askKey(refused) {
  return new Promise((resolve) => {
    const dialog = $("key-dialog");
    $("key-error").hidden = !refused;
    $("key-input").value = "";
    dialog.addEventListener("close", () => {
      const key = $("key-input").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      $("input").focus();  // back to the message box, ready to type
      resolve();
    }, {once: true});
    dialog.showModal();
    $("key-input").focus();
  });
}

function errorText(body, status) {
  return (body && body.error && body.error.message) ? `error ${status}: ${body.error.message}` : `error ${status}`;
}

// A field's number, or undefined (left out of the request: the server's default) when it is empty or not a number.
function numberField(id) {
  const text = $(id).value.trim();
  const value = Number(text);
  return text && Number.isFinite(value) ? value : undefined;
}

// max_tokens is an upper bound: "fit_context" (an extension of this server) cuts it to what the prompt leaves of
// the model's context, so a long conversation or a small model's context gets a shorter reply, not an error.
function requestBody(extra) {
  const body = {model: state.model, stream: true, temperature: numberField("temperature"),
                top_p: numberField("top-p"), max_tokens: numberField("max-tokens"), fit_context: true, ...extra};
  const topK = numberField("top-k");
  if (topK) body.top_k = topK;
  return body;
}

// POST a streaming request; onText(piece) for every piece of text; returns the finish reason ("stopped" when the
// user pressed Stop). Aborting the fetch closes the connection: the server notices and frees the request's row.
async function stream(path, body, onText) {
  state.controller = new AbortController();
  setBusy(true);
  showError("");
  let finish = null;
  try {
    const response = await fetch(path, {method: "POST", headers: headers(), body: JSON.stringify(body),
                                         signal: state.controller.signal});
    if (!response.ok) {
      let payload = null;
      try { payload = await response.json(); } catch (err) { /* not JSON */ }
      if (response.status === 401) { sessionStorage.removeItem(KEY_STORE); state.model = null; }
      throw new Error(errorText(payload, response.status));
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          const text = choice.delta ? choice.delta.content : choice.text;
          if (text) onText(text);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else showError(err.message);
  } finally {
    state.controller = null;
    setBusy(false);
  }
  return finish;
}

function setBusy(busy) {
  document.body.classList.toggle("busy", busy);
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  if (!busy) $("input").focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

// ---------------------------------------------------------------------------------------------- chat and completion
async function sendChat(text) {
  state.history.push({role: "user", content: text});
  addMessage("user", text);
  const body = addMessage("assistant", "");
  body.parentElement.classList.add("streaming");
  const system = $("system").value.trim();
  const messages = (system ? [{role: "system", content: system}] : []).concat(state.history);
  let reply = "";
  const finish = await stream("/v1/chat/completions", requestBody({messages}), (piece) => {
    reply += piece;
    renderText(body, reply);
    body.parentElement.scrollIntoView({block: "end"});
  });
  body.parentElement.classList.remove("streaming");
  body.parentElement.dataset.finish = finish || "error";
  if (finish === "stopped" || finish === "length") noteFinish(body.parentElement, finish);
  if (reply) state.history.push({role: "assistant", content: reply});
  else state.history.pop();  // failed or stopped before any text: do not send a question without its answer again
}

function noteFinish(box, finish) {
  const note = document.createElement("p");
  note.className = "finish";
  note.textContent = finish === "stopped" ? "(stopped)" : "(cut at max tokens)";
  box.append(note);
}

// Completion mode: the document is the prompt followed by what the model wrote; both are rendered as text.
async function sendCompletion(text) {
  const doc = $("document");
  doc.dataset.finish = "";
  let generated = "";
  renderText(doc, text);
  const finish = await stream("/v1/completions", requestBody({prompt: text}), (piece) => {
    generated += piece;
    renderText(doc, text + generated);
  });
  doc.dataset.finish = finish || "error";
  $("input").value = text + generated;  // continue from here with another Send
}

async function send(event) {
  if (event) event.preventDefault();
  const text = $("input").value;
  if (state.controller || !text.trim()) return;
  if (!state.model) await connect();
  if (!state.model) return;
  if ($("mode").value === "chat") {
    $("input").value = "";
    await sendChat(text);
  } else {
    await sendCompletion(text);
  }
}

function newChat() {
  stop();
  state.history = [];
  $("log").replaceChildren();
  $("document").replaceChildren();
  $("input").value = "";
  showError("");
  $("input").focus();
}

function setMode() {
  const chat = $("mode").value === "chat";
  $("chat-view").hidden = !chat;
  $("completion-view").hidden = chat;
  $("input").placeholder = chat ? "Message (Enter to send)" : "Text to continue (Enter to generate)";
  $("send").textContent = chat ? "Send" : "Generate";
}

// ---------------------------------------------------------------------------------------------- theme
const THEMES = ["auto", "light", "dark"];

function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  $("theme").textContent = `Theme: ${theme}`;
}

function cycleTheme() {
  const current = localStorage.getItem(THEME_STORE) || "auto";
  const next = THEMES[(THEMES.indexOf(current) + 1) % THEMES.length];
  localStorage.setItem(THEME_STORE, next);
  applyTheme(next);
}

// ---------------------------------------------------------------------------------------------- wiring
document.addEventListener("DOMContentLoaded", () => {
  applyTheme(localStorage.getItem(THEME_STORE) || "auto");
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller) { event.preventDefault(); stop(); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("theme").addEventListener("click", cycleTheme);
  $("mode").addEventListener("change", setMode);
  setMode();
  connect();
});
