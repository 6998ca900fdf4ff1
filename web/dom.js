// Small DOM and text helpers shared by the page's modules.

/** The element with this id. */
export const $ = (id) => document.getElementById(id);

/** An element with a class and text. */
export function el(tag, className = "", text = "") {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text) e.textContent = text;
  return e;
}

/** The last `n` or so characters of `text`, from a word's start. */
export function tail(text, n) {
  if (text.length <= n) return text.trim();
  const cut = text.slice(-n);
  return `…${cut.slice(cut.indexOf(" ") + 1)}`;
}

export function fmtMs(ms) {
  return ms >= 10000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}
