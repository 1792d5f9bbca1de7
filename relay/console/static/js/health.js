// An account's state for the page: one [class, label] pair. The relay's
// own health (GET /admin/accounts: health.state over the last 15 minutes)
// is the truth: an account whose attempts fail is "failing" even once its
// cooldown has lapsed, never a plain "ok". Without it (an older relay) the
// state is read from the blocks and the last error.
"use strict";

function breakerOpen(b, now) {
  return !!b && (b === "open" || b.state === "open" ||
    (typeof b.open_until === "number" && b.open_until > now));
}

export function stateOf(a, now) {
  const h = a.health || null;
  if (a.paused || (h && h.state === "paused")) { return ["disabled", "paused"]; }
  if (a.disabled) { return ["disabled", "disabled"]; }
  if (a.token_status === "needs_login" || (h && h.state === "needs_login")) { return ["disabled", "needs login"]; }
  if (breakerOpen(a.breaker, now)) { return ["breaker", "breaker open"]; }
  if (a.rate_limited_until && a.rate_limited_until > now) { return ["rate_limited", "rate limited"]; }
  if (a.schedulable === false) { return ["cooldown", "cooldown"]; }
  if (h) {
    if (h.state === "failing") { return ["failing", "failing"]; }
    if (h.state === "degraded") { return ["doubt", "degraded"]; }
  } else if (a.last_error_at && !(a.last_success_at > a.last_error_at) && (a.failovers || 0) > 0 &&
             !(a.turns > 0)) {
    // Every attempt failed and none served: failing, whatever the cooldown says.
    return ["failing", "failing"];
  }
  // Serving, but the refresh token may be spent.
  if (a.token_status === "in_doubt") { return ["doubt", "token in doubt"]; }
  if (h && h.state === "idle") { return ["ok", "idle"]; }
  return ["ok", "ok"];
}

// One line on the last 15 minutes: "7 of 7 failed" or "12 ok, 1 failed (8 %)".
export function healthLine(a) {
  const h = a.health;
  if (!h) { return ""; }
  if (!h.attempts) { return "no attempt in 15 min"; }
  return h.succeeded + " ok, " + h.failed + " failed in 15 min" +
    (h.client_faults ? " (+" + h.client_faults + " client faults)" : "");
}

// The account's last error, or null: only the account's own failures
// (the relay leaves a client's fault out of it).
export function lastError(a) {
  const le = (a.health && a.health.last_failure) || null;
  if (le) {
    const msg = le.message || "";
    const head = [le.reason, le.status].filter(Boolean).join(" ");
    return {text: head && msg.indexOf(head) !== 0 ? head + ": " + msg : msg || head, at: le.at};
  }
  if (!a.last_error) { return null; }
  const e = a.last_error;
  return {text: typeof e === "object" ? (e.reason || e.message || JSON.stringify(e)) : e,
          at: a.last_error_at};
}
