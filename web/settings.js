// The caller's settings: kept in localStorage, the page's mode and access token, the settings dialog's fields,
// and what the settings ask of the server (turn detection, captions). The tools box is tools.js's.
import { $ } from "./dom.js";

export const MODES = ["call", "voice", "kiosk"];
const STORE = "rtc-agent.settings";
const TOKEN_KEY = "rtc-agent.token";

export function loadSettings() {
  const defaults = { voice: "", instructions: "", processing: true, ptt: false, turn: "", micId: "", camId: "",
    mode: "", tools: "", toolChoice: "auto", captions: true };
  try {
    return { ...defaults, ...JSON.parse(localStorage.getItem(STORE) || "{}") };
  } catch {
    return defaults;
  }
}

export function saveSettings(s) {
  try { localStorage.setItem(STORE, JSON.stringify(s)); } catch { /* private mode */ }
}

export function resolveMode(params, settings) {
  const asked = (params.get("mode") || "").toLowerCase();
  if (MODES.includes(asked)) return asked;
  if (MODES.includes(settings.mode)) return settings.mode;
  const phone = matchMedia("(pointer: coarse) and (max-width: 640px)").matches;
  return phone ? "voice" : "call";
}

/** ?token= moves into sessionStorage and out of the address bar (history, screenshots, shared links). */
export function takeToken(params) {
  let token = "";
  try { token = sessionStorage.getItem(TOKEN_KEY) || ""; } catch { /* no storage */ }
  if (params.has("token")) {
    token = params.get("token") || "";
    storeToken(token);
    const url = new URL(location.href);
    url.searchParams.delete("token");
    history.replaceState(null, "", url);
  }
  return token;
}

export function storeToken(token) {
  try { sessionStorage.setItem(TOKEN_KEY, token); } catch { /* no storage */ }
}

/** session.update's turn_detection for the settings: null (push-to-talk), the chosen kind, or the server's. */
export async function turnDetection(s, config) {
  if (s.ptt) return null;
  if (!s.turn) return (await config)?.turn_detection ?? { type: "semantic_vad" };
  const [type, eagerness] = s.turn.split(":");
  return eagerness ? { type, eagerness } : { type };
}

/** session.update's input_audio_transcription for the settings: the server's recogniser, or null (off). */
export async function transcription(s, config) {
  if (!s.captions) return null;
  const model = (await config)?.input_audio_transcription?.model;
  return model ? { model } : {};
}

/** The transcript's note on a session.update the settings made. */
export function describeUpdate(u) {
  const parts = [];
  if (u.voice) parts.push(`voice ${u.voice}`);
  if ("instructions" in u) parts.push("instructions");
  const turn = u.turn_detection;
  if ("turn_detection" in u) {
    parts.push(!turn ? "push-to-talk" : turn.type === "semantic_vad" ? `smart turns (${turn.eagerness ?? "auto"})`
      : "fixed-silence turns");
  }
  if ("input_audio_transcription" in u) parts.push(u.input_audio_transcription ? "captions on" : "captions off");
  return `Updated: ${parts.join(", ")}`;
}

// ---- the settings dialog ----------------------------------------------------------------------------------
/** The dialog's fields (and the push-to-talk button) as the settings say; `tools` fills the tools box. */
export function showSettings(s, mode, tools) {
  if (s.voice) $("voice").value = s.voice;
  $("instructions").value = s.instructions;
  $("processing").checked = s.processing;
  $("ptt").checked = s.ptt;
  $("captions").checked = s.captions && !$("captions").disabled; // (disabled: the server makes none)
  $("turn").value = s.turn;
  tools.showSaved(s);
  $("ptt-btn").hidden = !s.ptt;
  document.documentElement.dataset.ptt = s.ptt ? "on" : "off";
  for (const r of document.querySelectorAll('input[name="mode"]')) r.checked = r.value === mode;
}

/** The dialog's fields into the settings `s` (saved); the mode picked (`mode` if none). */
export function readSettings(s, mode) {
  s.voice = $("voice").value;
  s.instructions = $("instructions").value;
  s.processing = $("processing").checked;
  s.ptt = $("ptt").checked;
  if (!$("captions").disabled) s.captions = $("captions").checked;
  s.turn = $("turn").value;
  s.micId = $("mic-select").value;
  s.camId = $("cam-select").value;
  s.tools = $("tools").value;
  s.toolChoice = $("tool-choice").value;
  s.mode = document.querySelector('input[name="mode"]:checked')?.value || mode;
  saveSettings(s);
  return s.mode;
}

/** GET api/config's voices and default instructions in the dialog. */
export function showServerDefaults(cfg, s) {
  if (Array.isArray(cfg.voices) && cfg.voices.length) {
    const select = $("voice");
    select.replaceChildren(...cfg.voices.map((v) => new Option(v[0].toUpperCase() + v.slice(1), v)));
    select.value = s.voice || cfg.voice || cfg.voices[0];
  }
  if (cfg.instructions) $("instructions").placeholder = cfg.instructions;
}

/** The server has no speech recogniser: the captions setting is off and says why. */
export function captionsUnavailable(note) {
  $("captions").disabled = true;
  $("captions").checked = false;
  $("captions-help").textContent = note || "This server makes no captions.";
  $("captions-help").hidden = false;
}

/** The microphone and camera selects: this device's inputs, the saved ones picked where they are still here. */
export async function listDevices(s) {
  if (!navigator.mediaDevices?.enumerateDevices) return;
  let devices;
  try { devices = await navigator.mediaDevices.enumerateDevices(); } catch { return; }
  const fill = (select, kind, current, fallback) => {
    const list = devices.filter((d) => d.kind === kind && d.deviceId && d.deviceId !== "default");
    select.replaceChildren(new Option(fallback, ""),
      ...list.map((d, i) => new Option(d.label || `${fallback.replace("Default ", "")} ${i + 1}`, d.deviceId)));
    select.value = list.some((d) => d.deviceId === current) ? current : "";
  };
  fill($("mic-select"), "audioinput", s.micId, "Default microphone");
  fill($("cam-select"), "videoinput", s.camId, "Default camera");
}
