// aivedio browser client: snapshot, then stream; exact resume by cursor. No dependencies.
//
//   import { createClient } from "/static/aivedio-client.js";
//   const client = createClient({ baseUrl: "", projectId, getStreamToken, apiKey, onTask, onState });
//   await client.start();            // snapshot + stream, BEFORE any task is created (seed 004)
//   await client.createTask({ provider: "sandbox", model: "sbx-1", prompt: "a cat", params: {} });
//   client.stop();                   // only when the view goes away
//
// Rules it keeps (docs/reference/events.md, DESIGN.md decisions 1-6):
// - The stream is opened before a task is created and stays open while the view is open; it is
//   never closed because a task finished.
// - An event is applied only if its task_version is higher than the one shown; a seq already
//   seen is ignored.
// - It remembers the last cursor (`<epoch>-<seq>`) and resumes with `?after=`; every (re)connect
//   gets a fresh stream token (they live <= 60 s), so it runs its own reconnect loop with
//   full-jitter exponential backoff instead of the EventSource's built-in one.
// - `event: reset` -> re-read the snapshot and go on from the reset's cursor.
// - After `maxFailures` consecutive failures it polls the snapshot every 10-30 s (jittered),
//   reports the state "paused" ("live updates paused"), keeps reconnecting in the background and
//   returns to "live" when a stream opens again.
//
// States passed to onState(state, detail): "connecting", "live", "paused", "stopped", "error"
// ("error": the server refused the credential for good, e.g. a revoked key; nothing is retried).

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

class HttpError extends Error {
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
 * @param {string} [options.apiKey]   DEMO ONLY: a real page never holds an API key; it passes
 *                                    getStreamToken and authHeaders backed by its own session.
 * @param {() => Promise<string>} [options.getStreamToken]  returns a fresh stream token
 * @param {() => object} [options.authHeaders]  headers for the REST calls (default: the API key)
 * @param {(task: object) => void} [options.onTask]   a task's view changed
 * @param {(state: string, detail: object) => void} [options.onState]
 * @param {(reset: object) => void} [options.onReset]  an `event: reset` arrived ({reason, cursor})
 */
export function createClient(options) {
  const {
    baseUrl = "",
    projectId,
    apiKey,
    onTask = () => {},
    onState = () => {},
    onReset = () => {},
    maxFailures = 3,
    backoffBaseMs = 500,
    backoffCapMs = 15000,
    pollMinMs = 10000,
    pollMaxMs = 30000,
    listLimit = 50,
    random = Math.random,
    EventSourceImpl = globalThis.EventSource,
    fetchImpl = (...args) => globalThis.fetch(...args),
  } = options;
  if (!projectId) throw new Error("projectId is required");
  const authHeaders =
    options.authHeaders || (() => (apiKey ? { Authorization: `Bearer ${apiKey}` } : {}));
  const project = encodeURIComponent(projectId);
  const api = (path) => `${baseUrl}/v1/projects/${project}${path}`;

  const tasks = new Map(); // task id -> the task as shown (a snapshot with events applied)
  let cursor = null; // `<epoch>-<seq>` of the last event applied, or of the snapshot
  let epoch = null;
  let lastSeq = -1;
  let source = null;
  let running = false;
  let state = "stopped";
  let failures = 0;
  let reconnectTimer = null;
  let pollTimer = null;
  let generation = 0; // bumps on every (re)connect so a stale EventSource's events are ignored
  const fetchingAsset = new Set();

  function setState(next, detail = {}) {
    if (next === state && next !== "paused") return;
    state = next;
    onState(next, { failures, cursor, ...detail });
  }

  async function request(method, path, body, headers = {}) {
    const init = { method, headers: { ...authHeaders(), ...headers }, cache: "no-store" };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetchImpl(api(path), init);
    const text = await response.text();
    const data = text ? JSON.parse(text) : null;
    if (!response.ok) throw new HttpError(response.status, data);
    return data;
  }

  const getStreamToken =
    options.getStreamToken ||
    (async () => {
      const response = await fetchImpl(`${baseUrl}/v1/stream-tokens`, {
        method: "POST",
        headers: { ...authHeaders(), "Content-Type": "application/json" },
        body: JSON.stringify({ project_id: projectId }),
        cache: "no-store",
      });
      const data = await response.json().catch(() => null);
      if (!response.ok) throw new HttpError(response.status, data);
      return data.token;
    });

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

  function onFrame(gen, frame) {
    if (gen !== generation) return;
    const id = parseCursor(frame.lastEventId);
    if (id && id.epoch === epoch && id.seq <= lastSeq) return; // a seq already seen
    let event;
    try {
      event = JSON.parse(frame.data);
    } catch {
      return;
    }
    applyEvent(event);
    if (id) moveCursor(frame.lastEventId);
  }

  async function handleReset(gen, frame) {
    if (gen !== generation) return;
    let data;
    try {
      data = JSON.parse(frame.data);
    } catch {
      return;
    }
    // The stream goes on from the reset's cursor; the snapshot is newer than it, and the
    // task_version rule drops the events between the two.
    moveCursor(data.cursor);
    onReset(data);
    try {
      await readSnapshot();
    } catch {
      // keep the stream; a later poll or reset reads it again
    }
  }

  function onClose(gen, frame) {
    if (gen !== generation) return;
    let data = {};
    try {
      data = JSON.parse(frame.data);
    } catch {
      // treat as a reconnectable close
    }
    if (data.reconnect === false) {
      closeSource();
      stopPolling();
      running = false;
      setState("error", { reason: data.reason, code: data.code });
      return;
    }
    fail(gen, data.reason || "closed");
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
      const token = await getStreamToken();
      if (gen !== generation || !running) return;
      const params = new URLSearchParams({ token });
      if (cursor !== null) params.set("after", cursor);
      source = new EventSourceImpl(api(`/events?${params}`));
    } catch (error) {
      if (error instanceof HttpError && (error.status === 401 || error.status === 403)) {
        // a refused credential does not get better by retrying it
        closeSource();
        stopPolling();
        running = false;
        setState("error", { reason: error.code || "unauthorized", status: error.status });
        return;
      }
      fail(gen, "connect_failed");
      return;
    }
    source.onopen = () => {
      if (gen !== generation) return;
      failures = 0;
      stopPolling();
      setState("live");
    };
    source.onerror = () => fail(gen, "stream_error");
    source.addEventListener("task.status", (frame) => onFrame(gen, frame));
    source.addEventListener("reset", (frame) => handleReset(gen, frame));
    source.addEventListener("close", (frame) => onClose(gen, frame));
  }

  function startPolling() {
    if (pollTimer !== null) return;
    const tick = async () => {
      try {
        // the stream cursor stays: the list covers only the newest tasks, so resuming from its
        // cursor could skip an older task's events; the replay (or a reset) is exact
        await readSnapshot();
      } catch {
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
      const path =
        task.asset.playback_url ||
        `/v1/projects/${project}/assets/${encodeURIComponent(task.asset.id)}/playback`;
      const response = await fetchImpl(`${baseUrl}${path}`, {
        headers: authHeaders(),
        cache: "no-store",
      });
      const data = await response.json().catch(() => null);
      if (!response.ok) throw new HttpError(response.status, data);
      return data.url;
    },
  };
}
