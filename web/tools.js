// The tools the agent may call: the settings dialog's tools box and tool choice, and the session.update that
// gives them to the server (its session.updated or its refusal settles it). The calls themselves: calls.js.
import { $ } from "./dom.js";
import { saveSettings } from "./settings.js";

const MAX_TOOLS_CHARS = 60000; // the server takes data-channel messages of at most 64 KiB
// "Fill in an example": two tools whose strings are bounded (maxLength), so that a call fits in an answer
const EXAMPLE_TOOLS = [
  { type: "function", name: "set_heating", description: "Set the seat heating of one row of the car.",
    parameters: { type: "object", required: ["zone", "level"], properties: {
      zone: { type: "string", enum: ["front", "back"] }, level: { type: "integer", minimum: 0, maximum: 5 } } } },
  { type: "function", name: "add_to_list", description: "Add items to the shopping list.",
    parameters: { type: "object", required: ["items"], properties: {
      items: { type: "array", items: { type: "string", maxLength: 20 }, minItems: 1, maxItems: 3 } } } },
];

/** The tools box's text: {tools} (a list; empty text is none) or {error}, said for the box. */
export function parseTools(text) {
  const src = text.trim();
  if (!src) return { tools: [] };
  if (src.length > MAX_TOOLS_CHARS) return { error: `The tools are too long (at most ${MAX_TOOLS_CHARS} characters).` };
  let tools;
  try {
    tools = JSON.parse(src);
  } catch (err) {
    return { error: `Not valid JSON: ${err.message}` };
  }
  if (!Array.isArray(tools)) return { error: 'The tools must be a JSON list: [{"type": "function", "name": …}, …]' };
  return { tools };
}

export function toolNames(tools) {
  return [...new Set(tools.filter((t) => typeof t?.name === "string" && t.name).map((t) => t.name))];
}

/** The tool choice select's value as session.update takes it: "auto", "none", "required" or a named function. */
export function toolChoice(value) {
  return value.startsWith("function:") ? { type: "function", name: value.slice("function:".length) } : value;
}

function choiceText(choice) {
  return typeof choice === "object" && choice ? `always ${choice.name}` : String(choice);
}

/**
 * The tools editor and the tools updates of the App `app` (its settings, call, transcript, alert and settings
 * dialog).
 */
export class Tools {
  constructor(app) {
    this.app = app;
    this.sent = null; // the tools update on its way to the server, until session.updated or its error
    this.error = ""; // the server's refusal of the last tools update, shown next to the box
  }

  bind() {
    $("tools").addEventListener("input", () => this.onInput());
    $("tools-example").addEventListener("click", () => {
      $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
      this.onInput();
    });
  }

  /** The box and the tool choice as the settings `s` say. */
  showSaved(s) {
    $("tools").value = s.tools;
    this.fillChoice(toolNames(parseTools(s.tools).tools ?? []), s.toolChoice);
    this.showError(this.error);
  }

  /** The tools box was edited: the tool choice offers its functions once the JSON parses. */
  onInput() {
    const { tools } = parseTools($("tools").value);
    if (!tools) return;
    this.fillChoice(toolNames(tools), $("tool-choice").value);
    this.showError("");
  }

  fillChoice(names, value) {
    const select = $("tool-choice");
    for (const o of [...select.options]) if (o.value.startsWith("function:")) o.remove();
    select.append(...names.map((n) => new Option(`${n}: every answer calls it`, `function:${n}`)));
    select.value = [...select.options].some((o) => o.value === value) ? value : "auto";
  }

  showError(text) {
    $("tools-error").textContent = text;
    $("tools-error").hidden = !text;
    $("tools").toggleAttribute("aria-invalid", !!text);
  }

  /** Apply: the tools box must parse (else its error shows, with the focus on it, and nothing changes). */
  check() {
    const { tools, error } = parseTools($("tools").value);
    const choice = $("tool-choice").value;
    const problem = error ?? (choice === "required" && !tools.length ? 'Tool choice "required" needs a tool.' : "");
    this.showError(problem);
    if (problem) $("tools").focus();
    return !problem;
  }

  /** session.update's tools and tool_choice for the saved settings. */
  update() {
    const s = this.app.settings;
    return { tools: parseTools(s.tools).tools ?? [], tool_choice: toolChoice(s.toolChoice) };
  }

  /** Sends a tools update; session.updated or the server's error about it settles it (see App.onEvent). */
  send(update) {
    this.error = "";
    this.showError("");
    if (this.app.call?.updateSession(update)) this.sent = update;
  }

  /** session.updated: the update sent is in force when its tool choice and tool names are the session's. */
  updated(session) {
    const sent = this.sent;
    const names = (list) => JSON.stringify(list.map((t) => t?.name));
    if (!sent || JSON.stringify(session.tool_choice) !== JSON.stringify(sent.tool_choice)) return;
    if (sent.tools && names(session.tools ?? []) !== names(sent.tools)) return;
    this.sent = null;
    const list = (session.tools ?? []).map((t) => t.name).join(", ") || "none";
    this.app.transcript.addNote(`Tools: ${list} · tool choice ${choiceText(session.tool_choice)}`);
  }

  refused(message) {
    this.sent = null;
    this.error = `The server refused the tools: ${message}. The call goes on with the tools it had.`;
    this.showError(this.error);
    this.app.transcript.addNote("Tools not accepted");
    this.app.alert.show({ title: "The tools were not accepted", text: message,
      action: { label: "Settings", fn: () => this.app.openSettings() } });
  }

  /** A call's "answer in words next": tool_choice auto, in the settings and on the server. */
  switchToAuto() {
    this.app.settings.toolChoice = "auto";
    saveSettings(this.app.settings);
    $("tool-choice").value = "auto";
    this.send({ tool_choice: "auto" });
  }
}
