// The connection panel (transport, cursor, reconnects, resumes, resets, polls, and a log of what
// the connection did) and the chaos panel (the sandbox provider's knobs, behind the API's
// credentials, and a stream outage: the gateway cuts this project's streams and refuses new ones
// for a while). The chaos panel shows only where the sandbox provider is enabled: the page says so
// (`<body data-sandbox="on">`, set by the server) and `GET /v1/sandbox/chaos` answers.
import { $, clock, showError } from "/static/console-view.js";

const LOG_MAX = 60;

export function createConnectionPanel(transport) {
  let last = null;
  $("conn-transport").textContent = transport === "websocket" ? "WebSocket" : "SSE";

  function log(kind, text) {
    const list = $("conn-log");
    const li = document.createElement("li");
    li.dataset.kind = kind;
    li.textContent = `${clock()} ${text}`;
    list.prepend(li);
    while (list.children.length > LOG_MAX) list.lastElementChild.remove();
  }

  function counters(info) {
    if (info.cursor !== undefined) $("conn-cursor").textContent = info.cursor || "—";
    const stats = info.stats;
    if (!stats) return;
    for (const name of ["reconnects", "resumes", "resets", "failures", "polls"]) {
      $(`conn-${name}`).textContent = String(stats[name]);
    }
  }

  return {
    state(state, info) {
      $("conn-state").textContent = state;
      if (state === "paused" && last !== "paused") log("paused", "live updates paused: polling the snapshot");
      if (state === "live" && last === "paused") log("resumed", "live updates resumed");
      if (state === "error") log("error", `refused for good (${info.reason || "unauthorized"})`);
      last = state;
      if (info.cursor !== undefined) $("conn-cursor").textContent = info.cursor || "—";
    },
    note(kind, info) {
      counters(info);
      if (kind === "open") {
        if (info.first) log("open", `stream opened at ${info.after || "the head"}`);
        else log("open", info.after ? `stream reopened, resuming after ${info.after}` : "stream reopened");
      } else if (kind === "failure") {
        log("failure", `stream lost (${info.reason})`);
      } else if (kind === "reset") {
        log("reset", `reset (${info.reason}): snapshot re-read, going on from ${info.resetTo}`);
      } else if (kind === "poll") {
        log("poll", "snapshot polled");
      }
    },
    /** The cursor moves with every event: keep the panel's figure current. */
    cursor(value) {
      $("conn-cursor").textContent = value || "—";
    },
  };
}

const RATES = ["drop_rate", "duplicate_rate", "reorder", "query_429_rate"];

function describe(knobs) {
  const on = [];
  if (!knobs.webhooks_enabled) on.push("webhooks off");
  for (const name of RATES) if (knobs[name] > 0) on.push(`${name.replace("_rate", "")} ${knobs[name]}`);
  if (knobs.query_slow_ms[1] > 0) on.push(`slow queries ${knobs.query_slow_ms[1]} ms`);
  return on.length ? `chaos on: ${on.join(", ")}` : "no chaos";
}

export async function createChaosPanel(client, callApi) {
  const panel = $("chaos");
  if (document.body.dataset.sandbox !== "on") return; // no sandbox provider here: no chaos panel
  let knobs;
  try {
    knobs = await callApi({ path: "/v1/sandbox/chaos" });
  } catch {
    return; // the sandbox does not answer: no chaos panel
  }
  panel.hidden = false;

  function fill(values) {
    knobs = values;
    for (const name of RATES) $(`chaos-${name}`).value = String(values[name]);
    $("chaos-query_slow_ms").value = String(values.query_slow_ms[1]);
    $("chaos-webhooks_enabled").checked = values.webhooks_enabled;
    $("chaos-state").textContent = describe(values);
    panel.dataset.chaos = describe(values);
  }

  async function put(patch) {
    showError("");
    try {
      fill(await callApi({ method: "PUT", path: "/v1/sandbox/chaos", body: patch }));
    } catch (error) {
      showError(`Could not change the chaos knobs: ${error.message}`);
    }
  }

  fill(knobs);
  $("chaos-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const patch = { webhooks_enabled: $("chaos-webhooks_enabled").checked };
    for (const name of RATES) patch[name] = Number($(`chaos-${name}`).value) || 0;
    const slow = Math.max(0, Number($("chaos-query_slow_ms").value) || 0);
    patch.query_slow_ms = [Math.floor(slow / 2), slow];
    put(patch);
  });
  $("chaos-reset").addEventListener("click", () =>
    put({
      webhooks_enabled: true,
      drop_rate: 0,
      duplicate_rate: 0,
      reorder: 0,
      query_429_rate: 0,
      query_slow_ms: [0, 0],
    }),
  );
  $("outage-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const seconds = Math.min(120, Math.max(1, Number($("outage-seconds").value) || 8));
    showError("");
    try {
      const answer = await client.call("POST", "/sandbox/stream-outage", { seconds });
      $("chaos-state").textContent =
        `${describe(knobs)}; realtime connection killed (${answer.closed} stream(s) cut), refused for ${seconds} s`;
    } catch (error) {
      showError(`Could not kill the connection: ${error.message}`);
    }
  });
}
