// aivedio browser client: snapshot, then stream; exact resume by cursor. No dependencies.
//
//   import { createClient, createSession } from "/static/aivedio-client.js";
//   const client = createClient({ baseUrl: "", projectId, transport: "sse", onTask, onState });
//   await client.start();            // snapshot + stream, BEFORE any task is created (seed 004)
//   await client.createTask({ provider: "sandbox", model: "sbx-1", prompt: "a cat", params: {} });
//   client.stop();                   // only when the view goes away
//
// Credentials, in this order: `getStreamToken` (a token for each stream, fetched from your
// backend), `apiKey` (server-side scripts and tests only; a page never holds one), else the
// browser session cookie `aivedio_session` (HttpOnly, set by `createSession` or by your backend):
// the browser sends it by itself with the REST calls, the EventSource and the WebSocket, so no
// credential ever appears in a URL. Every REST call carries `X-Aivedio-CSRF: 1`, which the API
// requires of unsafe requests authorized by the cookie.
//
// Transports (`transport`): "sse" (EventSource, the default) or "websocket". The same events,
// the same rules, the same cursor; the WebSocket resumes with `?after=<cursor>` on its URL too.
//
// Rules it keeps (docs/reference/events.md, DESIGN.md decisions 1-6):
// - The stream is opened before a task is created and stays open while the view is open; it is
//   never closed because a task finished.
// - An event is applied only if its task_version is higher than the one shown; a seq already
//   seen is ignored.
// - It remembers the last cursor (`<epoch>-<seq>`) and resumes with `?after=`; it runs its own
//   reconnect loop with full-jitter exponential backoff (every reconnect may need a fresh stream
//   token: they live <= 60 s) instead of the EventSource's built-in one.
// - `reset` -> re-read the snapshot and go on from the reset's cursor.
// - After `maxFailures` consecutive failures it polls the snapshot every 10-30 s (jittered),
//   reports the state "paused" ("live updates paused"), keeps reconnecting in the background and
//   returns to "live" when a stream opens again.
//
// States passed to onState(state, detail): "connecting", "live", "paused", "stopped", "error"
// ("error": the server refused the credential for good, e.g. a revoked key or session; nothing is
// retried).
//
// What the connection does, for a view that shows it (the web console's connection panel):
// onConnection(kind, detail) with kind "open" (detail.after: the cursor it resumed from, or null),
// "failure" (detail.reason), "reset" (detail.reason, detail.cursor) and "poll" (a snapshot read
// while paused); `client.stats` counts them ({opens, reconnects, resumes, resets, failures, polls}:
// a resume is a reconnect that went on from the cursor the page had).
// onEvent(event, cursor) sees every event with a seq not seen before, even one whose task_version
// the view already passed (a replay after polling): a timeline built from it misses nothing.

const FINAL = new Set(["ready", "failed", "canceled"]);

/** Parse `<epoch>-<seq>` into [epoch, seq] (numbers are kept as strings/Number safely). */
export function parseCursor(cursor) {
  if (typeof cursor !== "string") return null;
  const dash = cursor.lastIndexOf("-");
  if (dash <= 0) return null;
  const epoch = cursor.slice(0, dash);
  const seq = Number(cursor.slice(dash + 1));
  if (!/^\d+$/.test(epoch) || !Number.isSafeInteger(seq)) return null;
  return { epoch, seq };
}

/** Full-jitter exponential backoff: uniform(0, min(cap, base * 2^attempt)). */
export function backoffMs(attempt, baseMs, capMs, random = Math.random) {
  const ceiling = Math.min(capMs, baseMs * 2 ** Math.min(attempt, 30));
  return Math.floor(random() * ceiling);
}

export function isFinal(status) {
  return FINAL.has(status);
}

function newKey() {
  if (globalThis.crypto && typeof globalThis.crypto.randomUUID === "function") {
    return globalThis.crypto.randomUUID();
  }
  return `k-${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}

export const CSRF_HEADER = "X-Aivedio-CSRF";

/** The WebSocket URL of an API path (`baseUrl` "" = this page's origin). */
export function websocketUrl(baseUrl, path) {
  const base = baseUrl || globalThis.location.origin;
  return base.replace(/^http(s?):/i, "ws$1:") + path;
}

/**
 * Exchange an API key ONCE for the browser session cookie (`POST /v1/sessions`), then forget the
 * key: the cookie is HttpOnly (no script can read it) and authorizes everything that follows.
 * Returns the session's description `{id, project_id, created_at, expires_at}`.
 */
export async function createSession({ baseUrl = "", apiKey, projectId = null, fetchImpl }) {
  const doFetch = fetchImpl || ((...args) => globalThis.fetch(...args));
  const response = await doFetch(`${baseUrl}/v1/sessions`, {
    method: "POST",
    headers: { Authorization: `Bearer ${apiKey}`, "Content-Type": "application/json" },
    body: JSON.stringify(projectId ? { project_id: projectId } : {}),
    credentials: "same-origin",
    cache: "no-store",
  });
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new HttpError(response.status, data);
  return data.session;
}

/** The session the cookie holds (`GET /v1/sessions/current`), or null without a live one. */
export async function currentSession({ baseUrl = "", fetchImpl } = {}) {
  const doFetch = fetchImpl || ((...args) => globalThis.fetch(...args));
  const response = await doFetch(`${baseUrl}/v1/sessions/current`, {
    credentials: "same-origin",
    cache: "no-store",
  });
  if (response.status === 401) return null;
  const data = await response.json().catch(() => null);
  if (!response.ok) throw new HttpError(response.status, data);
  return data.session;
}

/** Revoke the session (`DELETE /v1/sessions/current`); its streams close within 5 s. */
export async function endSession({ baseUrl = "", fetchImpl } = {}) {
  const doFetch = fetchImpl || ((...args) => globalThis.fetch(...args));
  const response = await doFetch(`${baseUrl}/v1/sessions/current`, {
    method: "DELETE",
    headers: { [CSRF_HEADER]: "1" },
    credentials: "same-origin",
    cache: "no-store",
  });
  if (!response.ok) throw new HttpError(response.status, await response.json().catch(() => null));
}

export class HttpError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error ? body.error.code : null;
  }
}

/**
 * @param {object} options
 * @param {string} [options.baseUrl]  API origin ("" = the page's own origin)
 * @param {string} options.projectId
 * @param {"sse"|"websocket"} [options.transport]  how events arrive (default "sse")
 * @param {string} [options.apiKey]   server-side scripts and tests only: a page never holds an
 *                                    API key (it uses the session cookie, see createSession)
 * @param {() => Promise<string>} [options.getStreamToken]  returns a fresh stream token; without
 *                                    it and without apiKey the session cookie authorizes streams
 * @param {() => object} [options.authHeaders]  headers for the REST calls (default: the API key
 *                                    if any; the cookie needs none)
 * @param {(task: object) => void} [options.onTask]   a task's view changed
 * @param {(state: string, detail: object) => void} [options.onState]
 * @param {(reset: object) => void} [options.onReset]  a `reset` arrived ({reason, cursor})
 */
export function createClient(options) {
  const {
    baseUrl = "",
    projectId,
    apiKey,
    transport = "sse",
    onTask = () => {},
    onState = () => {},
    onReset = () => {},
    onEvent: onStreamEvent = () => {},
    onConnection = () => {},
    maxFailures = 3,
    backoffBaseMs = 500,
    backoffCapMs = 15000,
    pollMinMs = 10000,
    pollMaxMs = 30000,
    listLimit = 50,
    random = Math.random,
    EventSourceImpl = globalThis.EventSource,
    WebSocketImpl = globalThis.WebSocket,
    fetchImpl = (...args) => globalThis.fetch(...args),
  } = options;
  if (!projectId) throw new Error("projectId is required");
  if (transport !== "sse" && transport !== "websocket") {
    throw new Error('transport is "sse" or "websocket"');
  }
  const authHeaders =
    options.authHeaders || (() => (apiKey ? { Authorization: `Bearer ${apiKey}` } : {}));
  const project = encodeURIComponent(projectId);
  const path = (rest) => `/v1/projects/${project}${rest}`;
  const api = (rest) => `${baseUrl}${path(rest)}`;

  const tasks = new Map(); // task id -> the task as shown (a snapshot with events applied)
  let cursor = null; // `<epoch>-<seq>` of the last event applied, or of the snapshot
  let epoch = null;
  let lastSeq = -1;
  let source = null; // the EventSource or WebSocket
  let running = false;
  let state = "stopped";
  let failures = 0;
  let reconnectTimer = null;
  let pollTimer = null;
  let generation = 0; // bumps on every (re)connect so a stale stream's events are ignored
  const fetchingAsset = new Set();
  const stats = { opens: 0, reconnects: 0, resumes: 0, resets: 0, failures: 0, polls: 0 };
  let openedAfter = null; // the cursor the stream being opened resumes from

  function note(kind, detail = {}) {
    try {
      onConnection(kind, { ...detail, cursor, transport, stats: { ...stats } });
    } catch (error) {
      console.warn("aivedio onConnection failed", error);
    }
  }

  function setState(next, detail = {}) {
    if (next === state && next !== "paused") return;
    state = next;
    onState(next, { failures, cursor, transport, ...detail });
  }

  function headers(extra = {}) {
    return { [CSRF_HEADER]: "1", ...authHeaders(), ...extra };
  }

  async function request(method, rest, body, extra = {}) {
    const init = {
      method,
      headers: headers(extra),
      cache: "no-store",
      credentials: "same-origin",
    };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetchImpl(api(rest), init);
    const text = await response.text();
    const data = text ? JSON.parse(text) : null;
    if (!response.ok) throw new HttpError(response.status, data);
    return data;
  }

  // null: the session cookie authorizes the stream (nothing in the URL)
  const getStreamToken =
    options.getStreamToken ||
    (apiKey
      ? async () => {
          const response = await fetchImpl(`${baseUrl}/v1/stream-tokens`, {
            method: "POST",
            headers: headers({ "Content-Type": "application/json" }),
            body: JSON.stringify({ project_id: projectId }),
            cache: "no-store",
            credentials: "same-origin",
          });
          const data = await response.json().catch(() => null);
          if (!response.ok) throw new HttpError(response.status, data);
          return data.token;
        }
      : null);

  function moveCursor(next) {
    const parsed = parseCursor(next);
    if (!parsed) return;
    cursor = next;
    epoch = parsed.epoch;
    lastSeq = parsed.seq;
  }

  /** A snapshot replaces the shown task when it is at least as new (equal: fills in `asset`). */
  function applySnapshot(snapshot) {
    const shown = tasks.get(snapshot.id);
    if (shown && shown.task_version > snapshot.task_version) return;
    const merged = { ...snapshot };
    tasks.set(snapshot.id, merged);
    onTask(merged);
  }

  function applyEvent(event) {
    const shown = tasks.get(event.task_id);
    if (shown && shown.task_version >= event.task_version) return; // older or the same version
    const next = {
      ...(shown || { id: event.task_id, project_id: projectId, asset: null, error: null }),
      status: event.status,
      stage: event.stage,
      progress: event.progress,
      task_version: event.task_version,
      last_event_id: event.event_id,
      error: event.error || null,
    };
    if (event.asset_id && (!next.asset || next.asset.id !== event.asset_id)) {
      // the event carries the asset id only; the snapshot carries its playback path
      next.asset = { id: event.asset_id, playback_url: null };
      refreshTask(event.task_id);
    }
    tasks.set(event.task_id, next);
    onTask(next);
  }

  function refreshTask(taskId) {
    if (fetchingAsset.has(taskId)) return;
    fetchingAsset.add(taskId);
    request("GET", `/tasks/${encodeURIComponent(taskId)}`)
      .then((data) => applySnapshot(data.task))
      .catch(() => {}) // the next snapshot read (reset, polling) fills it in
      .finally(() => fetchingAsset.delete(taskId));
  }

  /** Read the task list: apply each snapshot; return the list's cursor (one read position). */
  async function readSnapshot() {
    const data = await request("GET", `/tasks?limit=${listLimit}`);
    for (const snapshot of data.tasks.slice().reverse()) applySnapshot(snapshot);
    return data.cursor;
  }

  // -- what both transports deliver ------------------------------------------------------

  /** One task event with its cursor `<epoch>-<seq>` (the SSE `id:`, the WebSocket `cursor`). */
  function onEvent(gen, eventCursor, event) {
    if (gen !== generation) return;
    const id = parseCursor(eventCursor);
    if (id && id.epoch === epoch && id.seq <= lastSeq) return; // a seq already seen
    if (id) moveCursor(eventCursor);
    onStreamEvent(event, eventCursor);
    applyEvent(event);
  }

  async function onResetData(gen, data) {
    if (gen !== generation) return;
    // The stream goes on from the reset's cursor; the snapshot is newer than it, and the
    // task_version rule drops the events between the two.
    moveCursor(data.cursor);
    stats.resets += 1;
    note("reset", { reason: data.reason, resetTo: data.cursor });
    onReset(data);
    try {
      await readSnapshot();
    } catch {
      // keep the stream; a later poll or reset reads it again
    }
  }

  function onOpened(gen) {
    if (gen !== generation) return;
    failures = 0;
    stopPolling();
    stats.opens += 1;
    if (stats.opens > 1) stats.reconnects += 1;
    if (stats.opens > 1 && openedAfter !== null) stats.resumes += 1;
    note("open", { after: openedAfter, first: stats.opens === 1 });
    setState("live");
  }

  /** The server closed the stream with a named reason: terminal ones stop for good. */
  function onClosed(gen, { reason, code, reconnect }) {
    if (gen !== generation) return;
    if (reconnect === false) {
      giveUp({ reason, code });
      return;
    }
    fail(gen, reason || "closed");
  }

  function giveUp(detail) {
    closeSource();
    stopPolling();
    running = false;
    clearTimeout(reconnectTimer);
    setState("error", detail);
  }

  // -- the two transports ----------------------------------------------------------------

  function parseData(frame) {
    try {
      return JSON.parse(frame.data);
    } catch {
      return null;
    }
  }

  function openEventSource(gen, params) {
    const query = params.toString();
    const es = new EventSourceImpl(api(`/events${query ? `?${query}` : ""}`), {
      withCredentials: true,
    });
    es.onopen = () => onOpened(gen);
    es.onerror = () => fail(gen, "stream_error");
    es.addEventListener("task.status", (frame) => {
      const data = parseData(frame);
      if (data) onEvent(gen, frame.lastEventId, data);
    });
    es.addEventListener("reset", (frame) => {
      const data = parseData(frame);
      if (data) onResetData(gen, data);
    });
    es.addEventListener("close", (frame) => {
      const data = parseData(frame) || {};
      onClosed(gen, data);
    });
    return es;
  }

  function openWebSocket(gen, params) {
    const query = params.toString();
    const ws = new WebSocketImpl(websocketUrl(baseUrl, path(`/ws${query ? `?${query}` : ""}`)));
    ws.onopen = () => onOpened(gen);
    ws.onmessage = (message) => {
      const data = parseData(message);
      if (!data) return;
      if (data.type === "task.status") {
        onEvent(gen, data.cursor, {
          event_id: data.event_id,
          task_id: data.task_id,
          task_version: data.task_version,
          ...data.payload,
        });
      } else if (data.type === "reset") {
        onResetData(gen, data);
      }
      // "start" (where a cursor-less stream begins) and command replies need nothing here
    };
    // 4500-4999: terminal (the close reason's code + 1000); anything else reconnects. A refused
    // handshake (401, 403) reaches a page only as a 1006 close: it is retried with backoff, then
    // polled, like a network failure (the EventSource cannot tell them apart either).
    ws.onclose = (event) =>
      onClosed(gen, {
        reason: event.reason || `ws_${event.code}`,
        code: event.code,
        reconnect: !(event.code >= 4500 && event.code < 5000),
      });
    ws.onerror = () => {}; // a close event always follows
    return ws;
  }

  function closeSource() {
    generation += 1;
    if (source) {
      source.close();
      source = null;
    }
  }

  function fail(gen, reason) {
    if (gen !== generation || !running) return;
    closeSource();
    failures += 1;
    stats.failures += 1;
    note("failure", { reason });
    if (failures >= maxFailures) {
      startPolling();
      setState("paused", { reason });
    } else {
      setState("connecting", { reason });
    }
    scheduleReconnect();
  }

  function scheduleReconnect() {
    clearTimeout(reconnectTimer);
    const cap = state === "paused" ? Math.max(backoffCapMs, pollMinMs) : backoffCapMs;
    reconnectTimer = setTimeout(connect, backoffMs(failures, backoffBaseMs, cap, random));
  }

  async function connect() {
    if (!running) return;
    closeSource();
    const gen = generation;
    try {
      if (cursor === null) moveCursor(await readSnapshot());
      const params = new URLSearchParams();
      if (getStreamToken) params.set("token", await getStreamToken());
      if (gen !== generation || !running) return;
      if (cursor !== null) params.set("after", cursor);
      openedAfter = cursor;
      source =
        transport === "websocket" ? openWebSocket(gen, params) : openEventSource(gen, params);
    } catch (error) {
      if (error instanceof HttpError && (error.status === 401 || error.status === 403)) {
        // a refused credential does not get better by retrying it
        giveUp({ reason: error.code || "unauthorized", status: error.status });
        return;
      }
      fail(gen, "connect_failed");
    }
  }

  function startPolling() {
    if (pollTimer !== null) return;
    const tick = async () => {
      try {
        // the stream cursor stays: the list covers only the newest tasks, so resuming from its
        // cursor could skip an older task's events; the replay (or a reset) is exact
        await readSnapshot();
        stats.polls += 1;
        note("poll");
      } catch (error) {
        if (error instanceof HttpError && (error.status === 401 || error.status === 403)) {
          // the credential is gone (an expired or revoked session): retrying cannot help
          giveUp({ reason: error.code || "unauthorized", status: error.status });
          return;
        }
        // still paused; try again at the next tick
      }
      if (pollTimer !== null) pollTimer = setTimeout(tick, jitteredPoll());
    };
    pollTimer = setTimeout(tick, 0);
  }

  function jitteredPoll() {
    return pollMinMs + Math.floor(random() * (pollMaxMs - pollMinMs));
  }

  function stopPolling() {
    clearTimeout(pollTimer);
    pollTimer = null;
  }

  return {
    tasks,
    get state() {
      return state;
    },
    get cursor() {
      return cursor;
    },
    get stats() {
      return { ...stats };
    },
    transport,
    /** One call of this project's API (`rest`: the path after `/v1/projects/{id}`). */
    call(method, rest, body) {
      return request(method, rest, body);
    },
    /** Ask to cancel (202 `cancel_requested`); 409 `not_cancelable` past the provider's work. */
    async cancelTask(taskId) {
      const data = await request("POST", `/tasks/${encodeURIComponent(taskId)}/cancel`);
      applySnapshot(data.task);
      return tasks.get(taskId);
    },
    /** A new attempt for a failed or canceled task (409 `not_retryable` otherwise). */
    async retryTask(taskId) {
      const data = await request("POST", `/tasks/${encodeURIComponent(taskId)}/retry`);
      applySnapshot(data.task);
      return tasks.get(taskId);
    },
    /** The task's public events, seq order, each with the fields it changed. */
    async taskEvents(taskId) {
      return (await request("GET", `/tasks/${encodeURIComponent(taskId)}/events`)).events;
    },
    /** The task's audit trail: events, ignored observations, unpublished versions. */
    async taskAudit(taskId) {
      return request("GET", `/tasks/${encodeURIComponent(taskId)}/audit`);
    },
    /** Snapshot, then open the stream. Call it before creating any task. */
    async start() {
      if (running) return;
      running = true;
      failures = 0;
      setState("connecting");
      await connect();
    },
    /** Close the stream and stop every timer (the view went away). */
    stop() {
      running = false;
      clearTimeout(reconnectTimer);
      stopPolling();
      closeSource();
      setState("stopped");
    },
    /**
     * Create a task. One Idempotency-Key per call, reused on every retry, so a retried create
     * never makes a second task. Retries on network errors and 5xx (3 attempts).
     */
    async createTask(body, { attempts = 3, idempotencyKey = newKey() } = {}) {
      let lastError = null;
      for (let attempt = 0; attempt < attempts; attempt += 1) {
        try {
          const data = await request("POST", "/tasks", body, { "Idempotency-Key": idempotencyKey });
          applySnapshot(data.task);
          return tasks.get(data.task.id);
        } catch (error) {
          lastError = error;
          if (error instanceof HttpError && error.status < 500) throw error;
          await new Promise((r) => setTimeout(r, backoffMs(attempt + 1, 300, 3000, random)));
        }
      }
      throw lastError;
    },
    /** A fresh, signed link to a ready task's video (the playback path re-checks the caller). */
    async playbackUrl(task) {
      if (!task.asset) return null;
      const assetPath =
        task.asset.playback_url ||
        `/v1/projects/${project}/assets/${encodeURIComponent(task.asset.id)}/playback`;
      const response = await fetchImpl(`${baseUrl}${assetPath}`, {
        headers: headers(),
        cache: "no-store",
        credentials: "same-origin",
      });
      const data = await response.json().catch(() => null);
      if (!response.ok) throw new HttpError(response.status, data);
      return data.url;
    },
  };
}

/** One call of the API outside a project (`path` from `/v1`), on the session cookie. */
export async function callApi({ baseUrl = "", method = "GET", path, body, fetchImpl }) {
  const doFetch = fetchImpl || ((...args) => globalThis.fetch(...args));
  const init = {
    method,
    headers: { [CSRF_HEADER]: "1" },
    credentials: "same-origin",
    cache: "no-store",
  };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await doFetch(`${baseUrl}${path}`, init);
  const text = await response.text();
  const data = text ? JSON.parse(text) : null;
  if (!response.ok) throw new HttpError(response.status, data);
  return data;
}
