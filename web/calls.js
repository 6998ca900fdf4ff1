// The agent's function calls: each call's card in its answer (name, streamed arguments, status), the form a
// developer answers a whole call with (function_call_output), and the response.create once every whole call of
// an answer has its result. Which tools the agent has: tools.js.
import { el } from "./dom.js";

const TOOL_RESULT = '{"ok": true}'; // what a call's result box starts with

/** The function calls of the App `app` (its call, session, transcript, tools and latency). */
export class FunctionCalls {
  constructor(app) {
    this.app = app;
    this.calls = new Map(); // by call_id: {id, name, args, done, cut, sent, responseId, ...}
  }

  /** A function call's arguments as they stream (`done`: whole, with its result box). */
  onArguments(msg, done) {
    const call = this.calls.get(msg.call_id) ?? this.newCall(msg);
    if (!call || call.done) return;
    call.args = done ? msg.arguments ?? call.args : call.args + (msg.delta ?? "");
    call.argsEl.textContent = call.args;
    if (done) {
      call.done = true;
      this.setStatus(call, "done", "done");
      call.card.append(this.resultForm(call));
    }
    this.app.transcript.scrollLog();
  }

  newCall(msg) {
    const r = this.app.transcript.response(msg.response_id);
    if (!r || !msg.call_id) return null;
    const card = el("div", "call");
    card.setAttribute("role", "group");
    card.setAttribute("aria-label", `Function call ${msg.name}`);
    card.dataset.callId = msg.call_id;
    const head = el("p", "call-head", "");
    const status = el("span", "call-status", "calling…");
    head.append(el("span", "call-tag", "Function call"), el("code", "call-name", msg.name ?? ""), status);
    const argsEl = el("pre", "call-args", "");
    card.append(head, argsEl);
    r.li.insertBefore(card, r.li.querySelector(".meta")); // (null: at the end)
    if (!r.text) r.li.querySelector(".text").hidden = true;
    const call = { id: msg.call_id, name: msg.name ?? "", args: "", done: false, cut: false, sent: false,
      responseId: r.id, card, argsEl, status };
    r.calls.push(call);
    this.calls.set(call.id, call);
    return call;
  }

  setStatus(call, text, kind) {
    call.status.textContent = text;
    call.card.dataset.status = kind;
  }

  /** The answer ended (barge-in, cancel, length limit) while this call was being written: it is not kept. */
  cut(call) {
    call.cut = true;
    this.setStatus(call, "cut off: not kept", "cut");
  }

  /** The box a developer answers a whole call with: the function's result, then the answer goes on. */
  resultForm(call) {
    const form = el("form", "call-result");
    const boxId = `result-${call.id}`;
    const label = el("label", "", `Result of ${call.name}`);
    label.htmlFor = boxId;
    const box = el("textarea", "code");
    Object.assign(box, { id: boxId, name: "output", rows: 2, maxLength: 8000, spellcheck: false, value: TOOL_RESULT });
    const send = el("button", "btn", "Send result");
    send.type = "submit";
    form.append(label, box);
    if (this.forcedToolChoice()) {
      const auto = el("label", "check");
      const tick = el("input");
      Object.assign(tick, { type: "checkbox", name: "auto", checked: true });
      auto.append(tick, el("span", "", "Then let the agent answer in words (tool choice auto)"));
      form.append(auto);
    }
    form.append(send);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.sendResult(call, form);
    });
    return form;
  }

  /** tool_choice "required" or a named function: the next answer would be a call again. */
  forcedToolChoice() {
    const choice = this.app.sessionInfo?.tool_choice;
    return choice === "required" || (typeof choice === "object" && !!choice);
  }

  sendResult(call, form) {
    const rtc = this.app.call;
    if (!rtc || call.sent || call.ended) return;
    if (form.elements.auto?.checked && this.forcedToolChoice()) this.app.tools.switchToAuto();
    const output = form.elements.output.value;
    rtc.send({ type: "conversation.item.create", item: { type: "function_call_output", call_id: call.id, output } });
    call.sent = true;
    for (const c of form.elements) c.disabled = true;
    this.setStatus(call, "result sent", "sent");
    this.continueAfter(this.app.transcript.responses.get(call.responseId));
  }

  /** response.create once the answer `r` is over and each of its whole calls has its result. */
  continueAfter(r) {
    const rtc = this.app.call;
    if (!r?.done || r.continued || !rtc) return;
    const whole = r.calls.filter((c) => c.done);
    if (!whole.length || whole.some((c) => !c.sent)) return;
    r.continued = true;
    this.app.latency.arm(performance.now()); // the next answer is heard after this
    rtc.send({ type: "response.create" });
  }

  /** The call is over: its function calls can no longer take results. */
  close() {
    for (const call of this.calls.values()) {
      if (!call.done || call.sent || call.ended) continue;
      call.ended = true;
      for (const c of call.card.querySelector("form").elements) c.disabled = true;
      this.setStatus(call, "call ended", "ended");
    }
  }
}
