// The alert banner under the top bar: a title, a text, one action button, the access token form.
import { $ } from "./dom.js";

export class Alert {
  constructor() {
    this._timer = null;
  }

  show({ title, text = "", action = null, token = false, kind = "error", autoHide = 0 }) {
    clearTimeout(this._timer);
    const a = $("alert");
    a.dataset.kind = kind;
    $("alert-title").textContent = title;
    $("alert-text").textContent = text.replace(/\s+/g, " ");
    const btn = $("alert-action");
    btn.hidden = !action;
    btn.onclick = action ? () => { this.hide(); action.fn(); } : null;
    if (action) btn.textContent = action.label;
    $("token-form").hidden = !token;
    a.hidden = false;
    if (token) $("token-input").focus();
    if (autoHide) this._timer = setTimeout(() => this.hide(), autoHide);
  }

  hide() {
    clearTimeout(this._timer);
    $("alert").hidden = true;
  }
}
