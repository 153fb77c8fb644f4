// The hooklatch inspector: a client of the gateway's admin API (/v1), served by the admin
// listener. Everything a request carried is shown as text: no value from the API ever
// becomes HTML (textContent only), so a webhook body cannot script this page.
"use strict";

const TOKEN_KEY = "hooklatch.adminToken";
const PAGE = 50;

const $ = (id) => document.getElementById(id);

/** An element with attributes and children (strings become text nodes). */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (name === "class") node.className = value;
    else if (name === "onclick") node.addEventListener("click", value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === undefined || child === null) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

class Unauthorized extends Error {}

function showError(message) {
  $("error").textContent = message || "";
}

/** Calls the admin API with the token; a 401 asks for the token again. */
async function api(path, options = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) {
    showLogin();
    throw new Unauthorized();
  }
  const res = await fetch(path, {
    ...options,
    headers: { ...(options.headers || {}), Authorization: "Bearer " + token },
  });
  if (res.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin("The gateway refused this token.");
    throw new Unauthorized();
  }
  const type = res.headers.get("content-type") || "";
  const body = type.includes("json") ? await res.json() : null;
  if (!res.ok) {
    throw new Error((body && body.message) || `HTTP ${res.status}`);
  }
  return body;
}

const SECTIONS = ["login", "requests", "detail", "dead", "destinations"];

function show(section) {
  for (const id of SECTIONS) $(id).hidden = id !== section;
  $("sign-out").hidden = section === "login";
  for (const [nav, active] of [
    ["nav-requests", section === "requests" || section === "detail"],
    ["nav-dead", section === "dead"],
    ["nav-destinations", section === "destinations"],
  ]) {
    $(nav).classList.toggle("active", active);
  }
}

function showLogin(message) {
  show("login");
  $("login-error").textContent = message || "";
  $("token").focus();
}

// ---------------------------------------------------------------------------------------------
// Requests

const list = { cursor: null, appended: false, shown: "" };

/** While "Live" is on and the first page is shown, the list is fetched again this often. */
const LIVE_EVERY_MS = 2000;

function filterQuery() {
  const params = new URLSearchParams({ limit: String(PAGE) });
  const source = $("filter-source").value.trim();
  const verdict = $("filter-verdict").value;
  const key = $("filter-key").value.trim();
  if (source) params.set("source", source);
  if (verdict) params.set("verdict", verdict);
  if (key) params.set("key", key);
  return params;
}

async function loadRequests(append) {
  const params = filterQuery();
  if (append && list.cursor) params.set("cursor", list.cursor);
  const page = await api("/v1/requests?" + params);
  const rows = $("request-rows");
  // The same first page as shown (a live refresh with nothing new): the rows stay as they
  // are, so nothing under the pointer moves.
  const shown = params.toString() + " " + page.items.map((r) => r.id + r.verdict).join(",");
  if (!append && shown === list.shown && rows.children.length > 0) return;
  list.shown = append ? "" : shown;
  if (!append) rows.replaceChildren();
  list.appended = append;
  for (const r of page.items) {
    const tr = el(
      "tr",
      { "data-id": r.id, class: "verdict-" + r.verdict },
      el("td", {}, el("a", { href: "#/requests/" + r.id }, r.id)),
      el("td", {}, r.received_at),
      el("td", {}, r.source),
      el("td", {}, verdictText(r)),
      el("td", {}, r.status),
      el("td", { class: "keys" }, (r.keys || []).join(" ")),
      el("td", { class: "num" }, r.body_len),
    );
    tr.addEventListener("click", () => {
      location.hash = "#/requests/" + r.id;
    });
    rows.append(tr);
  }
  list.cursor = page.next_cursor;
  $("more").hidden = !page.next_cursor;
  $("requests-empty").hidden = rows.children.length > 0;
}

/** The verdict with its refusal code, or a conflict's decision. */
function verdictText(r) {
  if (r.reason) return r.verdict + " (" + r.reason + ")";
  if (r.decision) return r.verdict + " (" + r.decision.action + ")";
  return r.verdict;
}

// ---------------------------------------------------------------------------------------------
// One request

function fact(dl, name, value) {
  if (value === undefined || value === null || value === "") return;
  dl.append(el("dt", {}, name), el("dd", {}, String(value)));
}

/**
 * JSON text indented for reading, without parsing its values: numbers, escapes and key order
 * stay exactly as sent (JSON.parse would round integers beyond 2^53).
 */
function indentJson(text) {
  let out = "";
  let depth = 0;
  let inString = false;
  let escaped = false;
  const newline = () => "\n" + "  ".repeat(depth);
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      out += c;
      if (escaped) escaped = false;
      else if (c === "\\") escaped = true;
      else if (c === '"') inString = false;
      continue;
    }
    if (c === " " || c === "\n" || c === "\r" || c === "\t") continue;
    if (c === '"') {
      inString = true;
      out += c;
    } else if (c === "{" || c === "[") {
      const close = c === "{" ? "}" : "]";
      let j = i + 1;
      while (j < text.length && " \n\r\t".includes(text[j])) j++;
      if (text[j] === close) {
        out += c + close;
        i = j;
      } else {
        depth++;
        out += c + newline();
      }
    } else if (c === "}" || c === "]") {
      depth--;
      out += newline() + c;
    } else if (c === ",") {
      out += "," + newline();
    } else if (c === ":") {
      out += ": ";
    } else {
      out += c;
    }
  }
  return out;
}

/** The body as text: indented when it is JSON, else as received; base64 when not UTF-8. */
function bodyText(detail) {
  if (detail.body === null) {
    return { raw: detail.body_base64, indented: null, note: "not UTF-8: base64" };
  }
  try {
    JSON.parse(detail.body);
  } catch (_) {
    return { raw: detail.body, indented: null, note: "" };
  }
  return { raw: detail.body, indented: indentJson(detail.body), note: "JSON" };
}

/** Shows the body indented or raw. */
function renderBody() {
  const body = $("detail-body");
  const shown = body.dataset.view === "raw" || body.indented === null ? body.raw : body.indented;
  body.textContent = shown;
  $("body-view").hidden = body.indented === null;
  $("body-view").textContent = body.dataset.view === "raw" ? "Indent" : "Raw";
}

/** A button that puts dead-lettered delivery `id` back in the queue, then runs `after`. */
function retryButton(id, after) {
  return el("button", {
    type: "button",
    class: "retry",
    "data-retry": id,
    onclick: async (event) => {
      event.target.disabled = true;
      try {
        await api(`/v1/deliveries/${id}/retry`, { method: "POST" });
        await after();
      } catch (err) {
        if (!(err instanceof Unauthorized)) showError(err.message);
        event.target.disabled = false;
      }
    },
  }, "Retry");
}

function deliveryBlock(d, requestId) {
  const block = el(
    "div",
    { class: "delivery state-" + d.state, "data-delivery": d.id },
    el("h4", {}, `${d.id} → ${d.destination} · ${d.state}`),
  );
  const facts = el("dl", { class: "facts" });
  fact(facts, "Idempotency-Key", d.idempotency_key);
  fact(facts, "attempts this round", d.attempts);
  fact(
    facts,
    "next attempt",
    d.held ? "when the destination is enabled" : d.next_attempt_at,
  );
  fact(facts, "last error", d.last_error);
  block.append(facts);
  if (d.history.length > 0) {
    const body = el("tbody");
    for (const a of d.history) {
      body.append(
        el(
          "tr",
          {},
          el("td", { class: "num" }, a.number),
          el("td", {}, a.started_at),
          el("td", {}, a.status === null ? "-" : a.status),
          el("td", { class: "num" }, a.latency_ms + " ms"),
          el("td", {}, a.error || ""),
        ),
      );
    }
    block.append(
      el(
        "table",
        { class: "attempts" },
        el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "started"), el("th", {}, "status"), el("th", {}, "took"), el("th", {}, "error"))),
        body,
      ),
    );
  }
  if (d.state === "dead") {
    block.append(retryButton(d.id, async () => {
      $("action-result").textContent = `${d.id} queued again`;
      await showDetail(requestId);
    }));
  }
  return block;
}

async function showDetail(id) {
  const detail = await api("/v1/requests/" + encodeURIComponent(id));
  show("detail");
  $("detail").dataset.id = detail.id;
  $("detail-title").textContent = `${detail.method} ${detail.path}`;
  const facts = $("detail-facts");
  facts.replaceChildren();
  fact(facts, "id", detail.id);
  fact(facts, "received", detail.received_at);
  fact(facts, "source", detail.source);
  fact(facts, "verdict", verdictText(detail));
  if (detail.decision) {
    const d = detail.decision;
    fact(facts, "decision", `${d.action} at ${d.at}` + (d.reason ? ": " + d.reason : ""));
  }
  fact(facts, "answered", detail.status);
  fact(facts, "event keys", (detail.keys || []).join(" "));
  fact(facts, "peer", detail.peer);
  const headers = $("detail-headers");
  headers.replaceChildren();
  for (const h of detail.headers) {
    const value = h.value !== undefined ? h.value : "(base64) " + h.value_base64;
    headers.append(el("tr", {}, el("th", {}, h.name), el("td", {}, value)));
  }
  const body = bodyText(detail);
  const pre = $("detail-body");
  pre.raw = body.raw;
  pre.indented = body.indented;
  renderBody();
  $("body-note").textContent = [
    `${detail.body_len} bytes`,
    body.note,
    detail.body_truncated ? "truncated: not read whole" : "",
  ].filter(Boolean).join(" · ");
  const deliveries = $("detail-deliveries");
  deliveries.replaceChildren();
  for (const d of detail.deliveries) deliveries.append(deliveryBlock(d, detail.id));
  if (detail.deliveries.length === 0) deliveries.append(el("p", { class: "empty" }, "None queued by this request."));
  const redeliver = $("redeliver");
  const dismissed = detail.decision && detail.decision.action === "dismissed";
  redeliver.hidden = (detail.keys || []).length === 0 || dismissed;
  // An undecided conflict can be dismissed instead of released.
  $("dismiss-box").hidden = !(detail.verdict === "conflict" && !detail.decision);
  $("dismiss").dataset.armed = "";
  $("dismiss").textContent = "Dismiss";
  $("dismiss-reason").value = "";
  redeliver.dataset.armed = "";
  // A conflict goes out as a new event, under a key of its own: say so on the button.
  redeliver.dataset.label = detail.verdict === "conflict" ? "Release as a new event" : "Redeliver";
  redeliver.textContent = redeliver.dataset.label;
}

/** Redeliver asks twice: the first click arms it for five seconds. */
async function redeliver() {
  const button = $("redeliver");
  const id = $("detail").dataset.id;
  if (!button.dataset.armed) {
    button.dataset.armed = "yes";
    button.textContent = "Click again to redeliver to every destination";
    setTimeout(() => {
      button.dataset.armed = "";
      button.textContent = button.dataset.label;
    }, 5000);
    return;
  }
  button.dataset.armed = "";
  button.textContent = button.dataset.label;
  try {
    const res = await api(`/v1/requests/${id}/redeliver`, { method: "POST" });
    $("action-result").textContent = "queued " + (res.deliveries || []).join(", ");
    await showDetail(id);
  } catch (err) {
    if (!(err instanceof Unauthorized)) showError(err.message);
  }
}

/** Dismiss asks twice, as Redeliver does. */
async function dismiss() {
  const button = $("dismiss");
  const id = $("detail").dataset.id;
  if (!button.dataset.armed) {
    button.dataset.armed = "yes";
    button.textContent = "Click again: this body will never be processed";
    setTimeout(() => {
      button.dataset.armed = "";
      button.textContent = "Dismiss";
    }, 5000);
    return;
  }
  button.dataset.armed = "";
  const reason = $("dismiss-reason").value.trim();
  try {
    await api(`/v1/requests/${id}/dismiss`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(reason ? { reason } : {}),
    });
    await showDetail(id);
    $("action-result").textContent = "dismissed";
  } catch (err) {
    if (!(err instanceof Unauthorized)) showError(err.message);
  }
}

// ---------------------------------------------------------------------------------------------
// The dead letter

async function loadDead() {
  const page = await api("/v1/deliveries?state=dead&limit=200");
  const rows = $("dead-rows");
  rows.replaceChildren();
  for (const d of page.items) {
    rows.append(
      el(
        "tr",
        { "data-delivery": d.id },
        el("td", {}, d.id),
        el("td", {}, d.destination),
        el("td", { class: "keys" }, d.idempotency_key),
        el("td", { class: "num" }, d.attempts),
        el("td", {}, d.last_error || ""),
        el("td", {}, el("a", { href: "#/requests/" + d.request_id }, d.request_id)),
        el("td", {}, retryButton(d.id, loadDead)),
      ),
    );
  }
  $("dead-empty").hidden = page.items.length > 0;
}

// ---------------------------------------------------------------------------------------------
// Destinations

/** Fetches the destinations; shows the banner naming the disabled ones. */
async function loadDestinations() {
  const page = await api("/v1/destinations");
  const disabled = page.items.filter((d) => !d.enabled);
  const banner = $("disabled-banner");
  banner.hidden = disabled.length === 0;
  banner.textContent = disabled
    .map((d) => `Destination ${d.name} is disabled since ${d.disabled_at} (${d.disabled_reason}): its deliveries wait.`)
    .join(" ");
  return page.items;
}

async function showDestinations() {
  const items = await loadDestinations();
  const rows = $("destination-rows");
  rows.replaceChildren();
  for (const d of items) {
    const action = d.enabled ? "disable" : "enable";
    const button = el("button", { type: "button", class: "small", "data-action": action }, d.enabled ? "Disable" : "Enable");
    button.addEventListener("click", async () => {
      // Disabling holds every delivery: it asks twice. Enabling sends what waited: once.
      if (action === "disable" && !button.dataset.armed) {
        button.dataset.armed = "yes";
        button.textContent = "Click again to hold its deliveries";
        return;
      }
      button.disabled = true;
      try {
        const res = await api(`/v1/destinations/${encodeURIComponent(d.name)}/${action}`, { method: "POST" });
        await showDestinations();
        $("destinations-result").textContent =
          action === "enable" ? `${d.name} enabled; ${res.woken} due now` : `${d.name} disabled`;
      } catch (err) {
        if (!(err instanceof Unauthorized)) showError(err.message);
      }
    });
    rows.append(
      el(
        "tr",
        { "data-destination": d.name },
        el("td", {}, d.name),
        el("td", {}, d.kind),
        el("td", {}, d.enabled ? "enabled" : "disabled"),
        el("td", {}, d.disabled_at || ""),
        el("td", {}, d.disabled_reason || ""),
        el("td", {}, button),
      ),
    );
  }
}

// ---------------------------------------------------------------------------------------------
// Routing

async function route() {
  showError("");
  $("action-result").textContent = "";
  if (!sessionStorage.getItem(TOKEN_KEY)) return showLogin();
  const hash = location.hash || "#/requests";
  try {
    const detail = hash.match(/^#\/requests\/(req_\d+)$/);
    if (detail) return await showDetail(detail[1]);
    if (hash === "#/dead") {
      show("dead");
      await loadDestinations();
      return await loadDead();
    }
    if (hash === "#/destinations") {
      show("destinations");
      $("destinations-result").textContent = "";
      return await showDestinations();
    }
    loadDestinations().catch(() => {});
    show("requests");
    await loadRequests(false);
  } catch (err) {
    if (!(err instanceof Unauthorized)) showError(err.message);
  }
}

function start() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    route();
  });
  $("sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin();
  });
  $("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    if (location.hash !== "#/requests") location.hash = "#/requests";
    else route();
  });
  $("refresh").addEventListener("click", () => route());
  $("dead-refresh").addEventListener("click", () => route());
  $("more").addEventListener("click", () => loadRequests(true).catch((err) => {
    if (!(err instanceof Unauthorized)) showError(err.message);
  }));
  $("redeliver").addEventListener("click", redeliver);
  $("dismiss").addEventListener("click", dismiss);
  $("body-view").addEventListener("click", () => {
    const pre = $("detail-body");
    pre.dataset.view = pre.dataset.view === "raw" ? "" : "raw";
    renderBody();
  });
  window.addEventListener("hashchange", route);
  // Live: new requests appear at the top of the first page without a click.
  setInterval(() => {
    const onList = !$("requests").hidden && !list.appended;
    if (onList && $("live").checked && sessionStorage.getItem(TOKEN_KEY)) {
      loadRequests(false).catch((err) => {
        if (!(err instanceof Unauthorized)) showError(err.message);
      });
    }
  }, LIVE_EVERY_MS);
  route();
}

document.addEventListener("DOMContentLoaded", start);
