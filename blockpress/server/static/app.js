// blockpress web page: a chat box streaming from /v1/chat/completions with
// stream_options.include_drafts, drawing every draft frame of the canvas as it denoises.
// Text mode (the default for models without a chat template) streams /v1/completions instead;
// with text in the second box it is insert mode (OpenAI's `suffix`): the model fills the gap
// between the two texts, seeing both. No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];          // the conversation sent with every request (OpenAI messages)
let busy = false;
let inFlight = null;               // the AbortController of the reply being streamed ("new chat" and "stop" abort it)
let stopping = false;              // the abort is "stop": the reply so far stays

$("apikey").value = localStorage.getItem("blockpress-key") || "";
$("apikey").addEventListener("change", () => {
  localStorage.setItem("blockpress-key", $("apikey").value);
  loadModel();  // a server with --api-key answered the first /v1/models with 401
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("apikey").value) h["Authorization"] = "Bearer " + $("apikey").value;
  return h;
}

function setMode(mode) {
  $("mode").value = mode;
  const text = mode === "text";
  $("suffix").hidden = !text;
  $("thinking").parentElement.hidden = text;
  $("prompt").placeholder = text ? "Text to continue, or the text before the gap (Enter sends)"
    : "Ask something… (Enter sends, Shift+Enter: new line)";
}
$("mode").addEventListener("change", () => setMode($("mode").value));

function loadModel() {
  fetch("/v1/models", { headers: headers() }).then(async (r) => {
    const j = await r.json().catch(() => ({}));
    if (!r.ok) {  // e.g. 401: the server wants the API key (the box on the right)
      $("model").textContent = `… (${r.status}: ${(j.error && j.error.message) || "no model list"})`;
      return;
    }
    const m = j.data && j.data[0];
    if (m) {
      $("model").textContent = `${m.id} · canvas ${m.canvas_length} tokens`;
      setMode(m.chat === false ? "text" : "chat");
      $("model").dataset.id = m.id;
    }
  }).catch(() => { $("model").textContent = "… (the server does not answer)"; });
}
loadModel();

const steps = $("steps");
const showSteps = () => { $("steps-out").textContent = steps.value === "0" ? "auto" : steps.value; };
steps.addEventListener("input", showSteps);
showSteps();

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text || "";
  const tools = document.createElement("div");
  tools.className = "tool";
  div.append(reasoning, content, tools);
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return { div, reasoning, content, tools };
}

// ---------------------------------------------------------------- canvas view
let prevTokens = null;
function drawDraft(f) {
  const canvas = $("canvas");
  canvas.replaceChildren();
  f.tokens.forEach((piece, j) => {
    const s = document.createElement("span");
    s.textContent = piece.replace(/\n/g, "⏎");
    s.className = f.accepted[j] ? "acc" : (prevTokens && prevTokens[j] === piece ? "stable" : "noise");
    canvas.append(s);
  });
  prevTokens = f.tokens;
  canvas.dataset.frames = String(Number(canvas.dataset.frames) + 1);
  canvas.dataset.accepted = String(Number(canvas.dataset.accepted || 0) + f.accepted.filter((a) => a).length);
  $("canvas-head").textContent = `· canvas ${f.canvas + 1} · step ${f.step}/${f.max_steps}`;
}

function drawStats(s) {
  const dl = $("stats");
  dl.replaceChildren();
  for (const [k, v] of Object.entries(s)) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v; dd.dataset.stat = k;
    dl.append(dt, dd);
  }
}

// ---------------------------------------------------------------- streaming
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");  // (SSE allows CRLF)
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i); buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

function setBusy(on) {
  busy = on; $("send").disabled = on; $("stop").hidden = !on;
}

// The request's JSON with the seed field's digits as they were typed: a JS number holds integers exactly only up to
// 2**53, so Number() sent another seed above it (and 2**64 - 1 as a number the server refuses).
function withSeed(body) {
  const seed = $("seed").value.trim();
  const json = JSON.stringify(body);
  if (seed === "") return json;
  if (!/^-?[0-9]+$/.test(seed)) throw new Error(`seed must be a whole number, got ${seed}`);
  return json.slice(0, -1) + `,"seed":${seed}}`;
}

async function send(text) {
  setBusy(true);
  const chat = $("mode").value === "chat";
  const suffix = chat ? "" : $("suffix").value;
  let out, asked;
  $("stats").replaceChildren();  // (the last reply's numbers are not this one's)
  if (chat) {
    conversation.push({ role: "user", content: text });
    asked = addMessage("user", text);
    out = addMessage("assistant", "");
  } else {  // one box: the given text plain, the model's text highlighted as it arrives
    out = addMessage("assistant", "");
    out.div.classList.add("completion");
    out.content.textContent = text;
    const fill = document.createElement("span");
    fill.className = "fill";
    out.content.append(fill, document.createTextNode(suffix));
    out.content = fill;
  }
  prevTokens = null;
  $("canvas").dataset.frames = "0";
  $("canvas").dataset.accepted = "0";
  const body = {
    stream: true,
    stream_options: { include_drafts: true, include_usage: true },
    max_tokens: Number($("max-tokens").value) || 256,
  };
  if (chat) {
    body.messages = conversation;
    body.chat_template_kwargs = { enable_thinking: $("thinking").checked };
  } else {
    body.prompt = text;
    if (suffix) body.suffix = suffix;
  }
  if ($("model").dataset.id) body.model = $("model").dataset.id;
  if (steps.value !== "0") body.steps = Number(steps.value);
  const t0 = performance.now();
  let firstCommit = null, canvases = 0, stepsTotal = 0, content = "", reasoning = "", done = false;
  try {
    const url = chat ? "/v1/chat/completions" : "/v1/completions";
    inFlight = new AbortController();
    const r = await fetch(url, { method: "POST", headers: headers(), body: withSeed(body),
                                 signal: inFlight.signal });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error((j.error && j.error.message) || `HTTP ${r.status}`);
    }
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") { done = true; break; }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.blockpress) {
        const f = chunk.blockpress;
        if (f.type === "draft") drawDraft(f);
        if (f.type === "commit") {  // the canvas is final: show it as plain text
          for (const s of $("canvas").children) s.className = "stable";
          canvases += 1; stepsTotal += f.steps; prevTokens = null;
          if (firstCommit === null) firstCommit = performance.now() - t0;
        }
      }
      for (const c of chunk.choices || []) {
        const d = c.delta || { content: c.text };
        if (d.reasoning_content) { reasoning += d.reasoning_content; out.reasoning.textContent = reasoning; }
        if (d.content) { content += d.content; out.content.textContent = content; }
        for (const tc of d.tool_calls || []) {
          out.tools.textContent += `→ ${tc.function.name}(${tc.function.arguments})\n`;
        }
      }
      if (chunk.usage) {
        const u = chunk.usage, secs = (performance.now() - t0) / 1000;
        drawStats({
          "tokens": u.completion_tokens,
          "tokens/s": (u.completion_tokens / secs).toFixed(1),
          "tokens/forward": u.tokens_per_forward.toFixed(2),
          "steps/canvas": canvases ? (stepsTotal / canvases).toFixed(1) : "–",
          "first commit": firstCommit === null ? "–" : `${firstCommit.toFixed(0)} ms`,
          "prompt tokens": u.prompt_tokens,
        });
      }
      $("log").scrollTop = $("log").scrollHeight;
    }
    if (!done) throw new Error("the stream ended before the reply did (did the server stop?)");
    if (chat) conversation.push({ role: "assistant", content });
    out.div.dataset.done = "1";
  } catch (e) {
    if (e.name === "AbortError" && stopping) {  // "stop": the reply so far stays, and in chat the conversation
      out.tools.textContent += "(stopped)";
      out.div.classList.add("stopped");
      if (chat) conversation.push({ role: "assistant", content });
      out.div.dataset.done = "1";
      return;
    }
    if (e.name === "AbortError") return;  // "new chat": the conversation and this reply are gone
    out.div.classList.add("error");
    // chat: the reply's place; text mode: below the text (not inside the highlighted fill)
    (chat ? out.content : out.tools).textContent = "error: " + e.message;
    if (chat) {  // the question is not in the conversation any more: shown as such
      conversation.pop();
      asked.div.classList.add("unsent");
      asked.div.title = "not sent again: its reply failed";
    }
    out.div.scrollIntoView({ block: "end" });
  } finally {
    inFlight = null; stopping = false; setBusy(false);
  }
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const chat = $("mode").value === "chat";
  const text = chat ? $("prompt").value.trim() : $("prompt").value;
  const gap = !chat && $("suffix").value.trim();  // insert mode may fill before the text after the gap alone
  if ((!text.trim() && !gap) || busy) return;
  if (chat) $("prompt").value = "";  // text mode keeps both boxes: edit and run again
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("reset").addEventListener("click", () => {
  if (inFlight) inFlight.abort();  // its reply must not land in the new conversation
  conversation.length = 0; $("log").replaceChildren(); $("canvas").replaceChildren(); $("stats").replaceChildren();
  $("canvas-head").textContent = "";
});
$("stop").addEventListener("click", () => {  // the server frees the row when the stream closes
  if (inFlight) { stopping = true; inFlight.abort(); }
});
