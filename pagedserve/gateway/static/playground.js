// The playground: a chat with the served model, streamed, with its sampling settings, each
// reply's time to first token, tokens per second, cached prompt tokens and finish reason;
// stop, regenerate, and the request as a curl or openai SDK snippet.
// Model output is only ever put into the page as text (textContent), never as HTML.
import { errorOf, headers } from "./api.js";
import { sseEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor(onUnauthorized) {
    this.model = "";
    this.history = []; // [{role, content}] of the conversation, without the system prompt
    this.lastBody = null; // the body of the latest request (for the snippets)
    this.controller = null; // the running reply's AbortController
    this.onUnauthorized = onUnauthorized;
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("message").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.send(); }
    });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape" && this.controller) this.stop(); });
    $("stop-button").addEventListener("click", () => this.stop());
    $("regenerate").addEventListener("click", () => this.regenerate());
    $("clear").addEventListener("click", () => this.clear());
    $("copy-curl").addEventListener("click", () => this.showSnippet(curlSnippet(this.bodyForSnippet())));
    $("copy-python").addEventListener("click", () => this.showSnippet(pythonSnippet(this.bodyForSnippet())));
  }

  setModel(name) { this.model = name; }

  // The request as the settings and the conversation make it now.
  body() {
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...this.history);
    const body = { model: this.model, messages, stream: true, stream_options: { include_usage: true } };
    const number = (id, parse) => { const v = $(id).value.trim(); return v === "" ? null : parse(v); };
    const temperature = number("temperature", parseFloat), topP = number("top-p", parseFloat);
    const maxTokens = number("max-tokens", (v) => parseInt(v, 10)), seed = number("seed", (v) => parseInt(v, 10));
    if (temperature !== null) body.temperature = temperature;
    if (topP !== null) body.top_p = topP;
    if (maxTokens !== null) body.max_tokens = maxTokens;
    if (seed !== null) body.seed = seed;
    const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
    if (stop.length) body.stop = stop;
    return body;
  }

  bodyForSnippet() {
    if (this.lastBody) return this.lastBody;
    const body = this.body();
    const text = $("message").value.trim();
    body.messages.push({ role: "user", content: text || "Hello!" });
    return body;
  }

  send() {
    const text = $("message").value;
    if (!text.trim() || this.controller) return;
    $("message").value = "";
    this.history.push({ role: "user", content: text });
    $("transcript").append(messageItem("user", text).item);
    this.run();
  }

  regenerate() {
    if (this.controller || !this.history.length) return;
    if (this.history[this.history.length - 1].role === "assistant") {
      this.history.pop();
      $("transcript").lastElementChild.remove();
    }
    this.run();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  clear() {
    this.stop();
    this.history = [];
    this.lastBody = null;
    $("transcript").replaceChildren();
    $("snippet").hidden = true;
    this.showError("");
  }

  showError(text) {
    $("error").textContent = text;
    $("error").hidden = !text;
  }

  showSnippet(text) {
    const pre = $("snippet");
    pre.textContent = text;
    pre.hidden = false;
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).catch(() => {});
  }

  setRunning(running) {
    $("send").disabled = running;
    $("stop-button").disabled = !running;
    $("regenerate").disabled = running || !this.history.length;
  }

  async run() {
    const body = this.body();
    this.lastBody = body;
    this.showError("");
    const { item, content, stats } = messageItem("assistant", "");
    item.setAttribute("aria-busy", "true");
    $("transcript").append(item);
    this.controller = new AbortController();
    this.setRunning(true);
    const started = performance.now();
    let text = "", firstAt = null, usage = null, finish = null, stopped = false;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: this.controller.signal,
      });
      if (!response.ok) throw await errorOf(response);
      for await (const chunk of sseEvents(response.body)) {
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            if (firstAt === null) firstAt = performance.now();
            text += delta;
            content.textContent = text;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    } catch (error) {
      if (error.name === "AbortError") stopped = true;
      else {
        if (error.status === 401) this.onUnauthorized(error.message);
        this.showError(error.message || String(error));
      }
    } finally {
      this.controller = null;
      item.removeAttribute("aria-busy");
    }
    const ended = performance.now();
    if (text || finish) this.history.push({ role: "assistant", content: text });
    else item.remove();
    stats.textContent = statsLine(started, firstAt, ended, usage, stopped ? "stopped" : finish);
    item.dataset.finish = stopped ? "stopped" : (finish || "");
    this.setRunning(false);
  }
}

function messageItem(role, text) {
  const item = document.createElement("li");
  item.className = "message " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Model";
  const content = document.createElement("p");
  content.className = "content";
  content.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  item.append(label, content, stats);
  return { item, content, stats };
}

function statsLine(started, firstAt, ended, usage, finish) {
  const parts = [];
  if (firstAt !== null) parts.push(`TTFT ${((firstAt - started) / 1000).toFixed(3)} s`);
  if (usage) {
    const seconds = firstAt !== null ? (ended - firstAt) / 1000 : 0;
    const decoded = Math.max(0, usage.completion_tokens - 1); // the first token's time is the TTFT
    if (seconds > 0 && decoded > 0) parts.push(`${(decoded / seconds).toFixed(1)} tok/s`);
    parts.push(`${usage.completion_tokens} tokens`);
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    parts.push(`cached prompt tokens ${cached === undefined || cached === null ? "n/a" : cached} of ${usage.prompt_tokens}`);
  }
  parts.push(`finish: ${finish || "none"}`);
  return parts.join(" · ");
}

function shellQuote(text) {
  return "'" + text.replace(/'/g, "'\\''") + "'";
}

export function curlSnippet(body) {
  const url = location.origin + "/v1/chat/completions";
  return [
    `curl -sN ${shellQuote(url)} \\`,
    `  -H 'Content-Type: application/json' \\`,
    `  -H "Authorization: Bearer $OPENAI_API_KEY" \\`,
    `  -d ${shellQuote(JSON.stringify(body))}`,
  ].join("\n");
}

export function pythonSnippet(body) {
  // a JSON string literal is a valid Python string literal
  return [
    "import json, os",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${JSON.stringify(location.origin + "/v1")}, api_key=os.environ.get("OPENAI_API_KEY", "unused"))`,
    `body = json.loads(${JSON.stringify(JSON.stringify(body))})`,
    "for chunk in client.chat.completions.create(**body):",
    "    if chunk.choices and chunk.choices[0].delta.content:",
    "        print(chunk.choices[0].delta.content, end=\"\", flush=True)",
    "print()",
  ].join("\n");
}
